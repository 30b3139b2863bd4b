"""The package's layering, read from the source: a module imports only from its own package
and from packages of a lower layer (docs/ARCHITECTURE.md draws the same table).

Every import counts, including those inside functions: a lazy import is still a dependency. The
two exceptions are named one by one in EXEMPT, with the reason.
"""
from __future__ import annotations

import ast
from pathlib import Path


SRC = Path(__file__).resolve().parents[2] / "src" / "gpt2lab"

# package -> layer; a module may import its own package and packages of strictly lower layers.
LAYERS = {
    "system": 0,       # errors, files, runtime facts and choices, hardware table: the stdlib and torch only
    "model": 1,        # the network, its config, its loss, LoRA adapters: no I/O
    "data": 2,         # tokenizer, sources, shards, loader, prepare
    "distributed": 3,  # process groups, DDP/FSDP wrapping, the memory planner
    "checkpoint": 4,   # saving and loading a run's state (full and sharded)
    "weights": 5,      # weights in and out: HF hub/dirs, export, --model arguments
    "inference": 6,    # sampling and completion
    "evals": 6,        # validation loss, HellaSwag
    "observe": 6,      # metrics, W&B, plots, reports
    "train": 7,        # the run plan, the trainer, optimizers, the spike guard, TrainConfig
    "serve": 8,        # the HTTP server
    "benchmarks": 9,   # gpt2lab bench ...: measure the layers below
    "commands": 10,    # the CLI's subcommands (`bench` runs the benchmarks)
    "cli": 11,
}
TOP = {"__init__", "__main__"}  # the package's front door (lazy API) and `python -m gpt2lab`
# The only imports that may point up, each named by (file, the function holding it, the package it
# imports): GPT.from_pretrained and model.generate, the habits of nanoGPT's and transformers' users,
# are one-line calls of gpt2lab.from_pretrained (weights) and inference.generate.generate, importing
# them inside the method so that importing the model never imports those layers. Any other upward
# import, in these methods too, fails; an exemption that matches no import fails as well.
EXEMPT = {
    ("model/gpt.py", "GPT.from_pretrained", "weights"),
    ("model/gpt.py", "GPT.generate", "inference"),
}


def package_of(path: Path, src: Path = SRC) -> str:
    rel = path.relative_to(src)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def gpt2lab_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, imported gpt2lab package, the enclosing functions and classes as ``A.b``, '' at module
    level) for every import statement in the file."""
    out = []

    def visit(node: ast.AST, scope: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = f"{scope}.{node.name}" if scope else node.name
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "gpt2lab" else [f"gpt2lab.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "gpt2lab" and len(parts) > 1:
                out.append((node.lineno, parts[1], scope))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return out


def violations(src: Path = SRC, exempt: set = EXEMPT) -> tuple[list[str], set]:
    """(every upward import not in ``exempt``, the exemptions that matched an import)."""
    bad, used = [], set()
    for path in sorted(src.rglob("*.py")):
        pkg = package_of(path, src)
        if pkg in TOP:
            continue
        if pkg not in LAYERS:
            bad.append(f"{path.relative_to(src)}: package {pkg!r} has no layer; add it to LAYERS")
            continue
        for line, target, scope in gpt2lab_imports(path):
            if target == pkg or target == "__version__":
                continue
            if target not in LAYERS or LAYERS[target] >= LAYERS[pkg]:
                key = (path.relative_to(src).as_posix(), scope, target)
                if key in exempt:
                    used.add(key)
                    continue
                bad.append(f"{path.relative_to(src)}:{line}: {pkg} (layer {LAYERS[pkg]}) imports "
                           f"{target} (layer {LAYERS.get(target, '?')})" + (f" in {scope}" if scope else ""))
    return bad, used


def test_every_import_points_down():
    bad, used = violations()
    assert bad == []
    assert used == EXEMPT, f"exemptions that match no import (remove them): {sorted(EXEMPT - used)}"


def test_the_check_catches_a_planted_upward_import(tmp_path):
    """A copy of the tree with one bad import (the model importing the trainer) fails the check."""
    import shutil

    tree = tmp_path / "gpt2lab"
    shutil.copytree(SRC, tree, ignore=shutil.ignore_patterns("__pycache__", "assets", "presets"))
    gpt = tree / "model" / "gpt.py"
    gpt.write_text(gpt.read_text() + "\n\ndef _planted():\n    from gpt2lab.train.trainer import Trainer  # noqa\n")
    found, _ = violations(tree)
    assert len(found) == 1 and found[0].startswith("model/gpt.py:") and "imports train" in found[0]


def test_the_exemptions_cover_exactly_their_two_imports(tmp_path):
    """The exempt methods may import their own package only; the same import anywhere else in the
    model fails; without the exemptions the two imports are the only upward ones."""
    import shutil

    tree = tmp_path / "gpt2lab"
    shutil.copytree(SRC, tree, ignore=shutil.ignore_patterns("__pycache__", "assets", "presets"))
    gpt = tree / "model" / "gpt.py"
    text = gpt.read_text()
    unexempted, _ = violations(tree, exempt=set())
    assert len(unexempted) == 2 and all(v.startswith("model/gpt.py:") for v in unexempted), unexempted
    assert any("imports weights (layer 5) in GPT.from_pretrained" in v for v in unexempted)
    assert any("imports inference (layer 6) in GPT.generate" in v for v in unexempted)
    # another package from an exempt method, and an exempt package from another method
    planted = text.replace("        from gpt2lab.inference.generate import generate\n",
                           "        from gpt2lab.inference.generate import generate\n"
                           "        from gpt2lab.serve.app import create_app  # noqa\n")
    planted = planted.replace("    def new_kv_cache(self, max_len: Optional[int] = None) -> KVCache:\n",
                              "    def new_kv_cache(self, max_len: Optional[int] = None) -> KVCache:\n"
                              "        from gpt2lab.weights.load import from_pretrained  # noqa\n")
    assert planted.count("# noqa") == text.count("# noqa") + 2
    gpt.write_text(planted)
    found, used = violations(tree)
    assert len(found) == 2 and used == EXEMPT, found
    assert any("imports serve (layer 8) in GPT.generate" in v for v in found)
    assert any("imports weights (layer 5) in GPT.new_kv_cache" in v for v in found)
