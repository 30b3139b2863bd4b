"""The package's layering, read from the source: a module imports only from its own package
and from packages of a lower layer (docs/ARCHITECTURE.md draws the same table).

Every import counts, including those inside functions: a lazy import is still a dependency.
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


def package_of(path: Path, src: Path = SRC) -> str:
    rel = path.relative_to(src)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def gpt2lab_imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported gpt2lab package) for every import statement in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "gpt2lab" else [f"gpt2lab.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "gpt2lab" and len(parts) > 1:
                out.append((node.lineno, parts[1]))
    return out


def violations(src: Path = SRC) -> list[str]:
    bad = []
    for path in sorted(src.rglob("*.py")):
        pkg = package_of(path, src)
        if pkg in TOP:
            continue
        if pkg not in LAYERS:
            bad.append(f"{path.relative_to(src)}: package {pkg!r} has no layer; add it to LAYERS")
            continue
        for line, target in gpt2lab_imports(path):
            if target == pkg or target == "__version__":
                continue
            if target not in LAYERS or LAYERS[target] >= LAYERS[pkg]:
                bad.append(f"{path.relative_to(src)}:{line}: {pkg} (layer {LAYERS[pkg]}) imports "
                           f"{target} (layer {LAYERS.get(target, '?')})")
    return bad


def test_every_import_points_down():
    assert violations() == []


def test_the_check_catches_a_planted_upward_import(tmp_path):
    """A copy of the tree with one bad import (the model importing the trainer) fails the check."""
    import shutil

    tree = tmp_path / "gpt2lab"
    shutil.copytree(SRC, tree, ignore=shutil.ignore_patterns("__pycache__", "assets", "presets"))
    gpt = tree / "model" / "gpt.py"
    gpt.write_text(gpt.read_text() + "\n\ndef _planted():\n    from gpt2lab.train.trainer import Trainer  # noqa\n")
    found = violations(tree)
    assert len(found) == 1 and found[0].startswith("model/gpt.py:") and "imports train" in found[0]
