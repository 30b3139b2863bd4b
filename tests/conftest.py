"""Shared tiny-model fixtures (CPU, seconds). Other areas may append fixtures at the end."""
from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.weights import hf

# gpt2lab's cache (the CPU and decode probes, downloads) goes to a directory of this test session,
# never the user's ~/.cache/gpt2lab: GPT2LAB_CACHE is what the code reads, and the processes the
# tests start inherit it. The first conftest of a session makes it (pytest-xdist's workers inherit
# it from the controller through GPT2LAB_TEST_CACHE) and removes it when that process ends.
if not os.environ.get("GPT2LAB_TEST_CACHE"):
    os.environ["GPT2LAB_TEST_CACHE"] = tempfile.mkdtemp(prefix="gpt2lab-test-cache-")
    atexit.register(shutil.rmtree, os.environ["GPT2LAB_TEST_CACHE"], True)
os.environ["GPT2LAB_CACHE"] = os.environ["GPT2LAB_TEST_CACHE"]

TESTS = Path(__file__).resolve().parent  # shared helpers live here; unit/ and e2e/ hold the tests
DATA = TESTS / "data"                    # small fixtures: HellaSwag slice, text slices
ROOT = TESTS.parent                      # the repository

# Two deliberately different small shapes, so a transpose or head-split bug cannot hide
# behind a square matrix or a single head.
TINY_SHAPES = [
    dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=128),
    dict(n_layer=3, n_head=4, n_embd=48, n_positions=96, vocab_size=211),
]


def hf_gpt2(seed: int = 0, **shape):
    """A randomly initialised transformers GPT2LMHeadModel (eval, fp32); its init is HF's own."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(**shape)
    return transformers.GPT2LMHeadModel(config).eval()


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    """A randomly initialised gpt2lab GPT, small enough for any CPU test."""
    torch.manual_seed(seed)
    cfg = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=128)
    return GPT(GPTConfig(**{**cfg, **overrides})).eval()


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> list[tuple[object, str]]:
    """(transformers model, its save_pretrained directory) for each of TINY_SHAPES."""
    out = []
    for i, shape in enumerate(TINY_SHAPES):
        model = hf_gpt2(seed=i, **shape)
        d = str(tmp_path_factory.mktemp(f"hf{i}"))
        model.save_pretrained(d)
        out.append((model, d))
    return out


@pytest.fixture(scope="session")
def gpt2_vocab_export(tmp_path_factory) -> tuple[GPT, str]:
    """A tiny GPT with the real GPT-2 vocabulary, exported as an HF dir (for CLI tests)."""
    model = tiny_gpt(seed=3, vocab_size=50257, block_size=128)
    d = str(tmp_path_factory.mktemp("gpt2vocab") / "model")
    hf.save_pretrained(model, d)
    return model, d


def run_gpt2lab(*args: str, env: dict | None = None, timeout: float = 120,
                cwd: str | None = None) -> subprocess.CompletedProcess:
    """``python -m gpt2lab ARGS`` in a fresh process (for exit codes and real stdout/stderr)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "gpt2lab", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=cwd)


# Session fixtures of train_utils that several modules use: defined here once, so the session
# makes them once (a fixture imported into each module is made once per module).
from train_utils import finished_run, tiny_data  # noqa: E402, F401


@pytest.fixture(scope="module")
def hf_ref(tmp_path_factory):
    """A tiny random transformers GPT-2 with the real vocabulary, saved as an HF dir.

    The embeddings are scaled up so the logits are far from uniform: with the default
    init every ending would score about log(50257) and predictions would be coin flips
    decided by rounding.
    """
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=128, vocab_size=50257)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        model.transformer.wte.weight.mul_(5)
    d = str(tmp_path_factory.mktemp("hs_hf"))
    model.save_pretrained(d)
    return model, d


def damaged_copy(src: str, dst: str, what: str) -> str:
    """A copy of the HF directory ``src`` with model.safetensors cut in half, or config.json cut
    mid-value; returns the damaged file's path."""
    shutil.copytree(src, dst)
    if what == "weights":
        path = os.path.join(dst, "model.safetensors")
        os.truncate(path, os.path.getsize(path) // 2)
    else:
        path = os.path.join(dst, "config.json")
        with open(path, "w") as f:
            f.write('{"model_type": "gpt2", "n_layer": ')
    return path
