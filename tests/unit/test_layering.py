"""The package's layering, read from the source: a module imports only from its own package
and from packages of a lower layer (docs/ARCHITECTURE.md draws the same table).

Every import counts, including those inside functions: a lazy import is still a dependency. There is
one exception (``EXEMPT``): ``GPT.from_pretrained``, the seed's habit, reaches the one loader
(weights/load.py) by an import made only when it is called. And no two files import each other, however
indirectly (``file_cycles``): within a package too, the imports between files form no circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "gpt2lab"

# package -> layer; a module may import its own package and packages of strictly lower layers.
LAYERS = {
    "system": 0,  # errors, files, runtime facts and choices, hardware table: the stdlib and torch only
    "model": 1,  # the network, its config, its loss, LoRA adapters: no I/O
    "data": 2,  # tokenizer, sources, shards, loader, prepare
    "distributed": 3,  # process groups, DDP/FSDP wrapping, the memory planner
    "checkpoint": 4,  # saving and loading a run's state (full and sharded)
    "weights": 5,  # weights in and out: HF hub/dirs, export, --model arguments
    "inference": 6,  # sampling and completion
    "evals": 6,  # validation loss, HellaSwag
    "observe": 6,  # metrics, W&B, plots, reports
    "train": 7,  # the run plan, the trainer, optimizers, the spike guard, TrainConfig
    "serve": 8,  # the HTTP server
    "benchmarks": 9,  # gpt2lab bench ...: measure the layers below
    "commands": 10,  # the CLI's subcommands (`bench` runs the benchmarks)
    "cli": 11,
}
TOP = {"__init__", "__main__"}  # the package's front door (lazy API) and `python -m gpt2lab`
# (file, function) whose imports neither check counts: the classmethod that delegates to the loader.
EXEMPT = {("model/gpt.py", "GPT.from_pretrained")}


def package_of(path: Path, src: Path = SRC) -> str:
    rel = path.relative_to(src)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def gpt2lab_imports(path: Path, src: Path = SRC) -> list[tuple[int, str, str, list[str]]]:
    """(line, imported gpt2lab package, the enclosing functions and classes as ``A.b`` ('' at module
    level), the modules it names: ``from gpt2lab.x import y`` names gpt2lab.x and gpt2lab.x.y) for every
    import statement in the file, but those in an ``EXEMPT`` function."""
    out = []
    rel = path.relative_to(src).as_posix()

    def visit(node: ast.AST, scope: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = f"{scope}.{node.name}" if scope else node.name
        if (rel, scope) in EXEMPT:
            return
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "gpt2lab":
            names = [f"gpt2lab.{a.name}" for a in node.names]  # the front door's __version__ is no file
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        for package in dict.fromkeys(n.split(".")[1] for n in names if n.startswith("gpt2lab.")):
            out.append((node.lineno, package, scope, names))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return out


def violations(src: Path = SRC) -> list[str]:
    """Every upward import in the tree."""
    bad = []
    for path in sorted(src.rglob("*.py")):
        pkg = package_of(path, src)
        if pkg in TOP:
            continue
        if pkg not in LAYERS:
            bad.append(f"{path.relative_to(src)}: package {pkg!r} has no layer; add it to LAYERS")
            continue
        for line, target, scope, _ in gpt2lab_imports(path, src):
            if target == pkg or target == "__version__":
                continue
            if target not in LAYERS or LAYERS[target] >= LAYERS[pkg]:
                bad.append(
                    f"{path.relative_to(src)}:{line}: {pkg} (layer {LAYERS[pkg]}) imports "
                    f"{target} (layer {LAYERS.get(target, '?')})" + (f" in {scope}" if scope else "")
                )
    return bad


def module_of(path: Path, src: Path = SRC) -> str:
    rel = path.relative_to(src).with_suffix("")
    parts = ("gpt2lab", *rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def file_imports(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the gpt2lab modules (files) it imports, anywhere in it, ``from gpt2lab.x import y`` counting
    as an import of ``gpt2lab.x.y`` where that is a file."""
    modules = {module_of(p, src): p for p in src.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for _, _, _, names in gpt2lab_imports(path, src):
            edges[mod] |= {n for n in names if n in modules and n != mod}
    return edges


def file_cycles(src: Path = SRC) -> list[list[str]]:
    """The circles among the files' imports: each strongly connected group of two or more modules."""
    edges = file_imports(src)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_import_points_down():
    assert violations() == []


def test_no_two_files_import_each_other():
    assert file_cycles() == []


def test_the_check_catches_a_planted_upward_import(tmp_path):
    """A copy of the tree with one bad import (the model importing the trainer) fails the check."""
    import shutil

    tree = tmp_path / "gpt2lab"
    shutil.copytree(SRC, tree, ignore=shutil.ignore_patterns("__pycache__", "assets", "presets"))
    gpt = tree / "model" / "gpt.py"
    gpt.write_text(gpt.read_text() + "\n\ndef _planted():\n    from gpt2lab.train.trainer import Trainer  # noqa\n")
    found = violations(tree)
    assert len(found) == 1 and found[0].startswith("model/gpt.py:") and "imports train" in found[0]


def test_the_check_catches_a_planted_circle_between_files(tmp_path):
    """The model importing the sampling loop lazily is fine; the loop importing the model back is a circle
    (inside one package, so the layering alone would not see it), and so is a longer one."""
    import shutil

    tree = tmp_path / "gpt2lab"
    shutil.copytree(SRC, tree, ignore=shutil.ignore_patterns("__pycache__", "assets", "presets"))
    sampling = tree / "model" / "sampling.py"
    sampling.write_text(sampling.read_text() + "\n\ndef _planted():\n    from gpt2lab.model.gpt import GPT  # noqa\n")
    assert file_cycles(tree) == [["gpt2lab.model.gpt", "gpt2lab.model.sampling"]]
    shutil.copy(SRC / "model" / "sampling.py", sampling)
    loader = tree / "data" / "loader.py"
    loader.write_text(loader.read_text() + "\n\ndef _planted():\n    from gpt2lab.data import prepare  # noqa\n")
    cycles = file_cycles(tree)
    assert len(cycles) == 1 and "gpt2lab.data.loader" in cycles[0] and "gpt2lab.data.prepare" in cycles[0]
