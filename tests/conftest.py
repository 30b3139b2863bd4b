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
from gpt2lab.weights import export

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
    """A randomly initialised gpt2lab GPT, small enough for any CPU test; ``tokenizer`` may be a trained
    tokenizer, which the model then holds (its identity goes in the config)."""
    torch.manual_seed(seed)
    cfg = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=128)
    own = overrides.get("tokenizer")
    if own is not None and not isinstance(own, str):
        overrides = {**overrides, "tokenizer": own.identity}
    return GPT(GPTConfig(**{**cfg, **overrides}), None if isinstance(own, str) else own).eval()


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
    export.save_pretrained(model, d)
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


# --- gpt2lab serve: a running app (uvicorn in a thread, on a free port), the servers several test
# modules share, and requests and /metrics as the serve tests make and read them

import contextlib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from typing import Iterator  # noqa: E402

from gpt2lab.serve.limits import Limits  # noqa: E402


@contextlib.contextmanager
def serving_in_thread(workers: dict, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve ``workers`` with uvicorn and their engine each in a background thread on a free port;
    yield the base URL. The workers are closed on exit. (``gpt2lab serve`` runs the engine in its main
    thread instead: serve.server.serve_here.)"""
    from gpt2lab.serve.engine import Engine
    from gpt2lab.serve.server import bind, uvicorn_in_thread

    engine = Engine(workers).start()
    with uvicorn_in_thread(workers, bind(host, 0)) as url:  # port 0: the OS picks a free port
        try:
            yield url
        finally:
            engine.close()


@contextlib.contextmanager
def running_server(models: list[str], limits=None, deterministic: bool = False, linear: str = "packed",
                   dtype: str = "float32", quantize: str = "none") -> Iterator[str]:
    """Load ``models`` ([NAME=]MODEL, as on the command line) on CPU, serve them; yield the base URL.
    ``limits`` (serve.limits.Limits), ``deterministic``, ``linear`` (--cpu-linear), ``dtype`` and
    ``quantize`` are the serve flags of those names; the tests run fp32 packed linears (one candidate:
    nothing is measured), what ``auto`` picks for fp32 on most CPUs."""
    pytest.importorskip("uvicorn", reason="gpt2lab serve needs the serve extra (fastapi, uvicorn)")
    from gpt2lab.inference.choice import InferenceRequest
    from gpt2lab.serve.models import load_workers

    request = InferenceRequest(dtype=dtype, quantize=quantize, linear=linear)
    with serving_in_thread(load_workers(models, "cpu", request, limits, deterministic)) as url:
        yield url


def scrape(url: str) -> dict:
    """/metrics parsed by prometheus_client's own parser: {(name, labels...): value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, *sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


def wait_until_idle(url: str, model: str, timeout: float = 30) -> dict:
    """Poll /metrics until ``model`` has no request waiting and no row generating; the last scrape.
    A client's hang-up reaches the server asynchronously: this is how a test knows it has."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        busy = m[("gpt2lab_queue_depth", ("model", model))], m[("gpt2lab_active_rows", ("model", model))]
        if busy == (0, 0) or time.monotonic() > deadline:
            assert busy == (0, 0), f"after {timeout:g} s model {model!r} still has (waiting, rows) {busy}"
            return m
        time.sleep(0.02)


@pytest.fixture(scope="module")
def pair_server(gpt2_vocab_export):
    """The batching server with two names for the tiny real-vocabulary model: "tiny" and "twin"."""
    _, d = gpt2_vocab_export
    with running_server([f"tiny={d}", f"twin={d}"]) as url:
        yield url, d


@pytest.fixture(scope="module", params=["batched", "turns"])
def tiny_server(request, gpt2_vocab_export):
    """The tiny real-vocabulary model as "tiny", in both server modes; the batching worker runs prompts
    7 tokens per step, so that scoring crosses chunks. Yields the URL and the model."""
    model, d = gpt2_vocab_export
    with running_server([f"tiny={d}"], Limits(prefill_chunk=7), deterministic=request.param == "turns") as url:
        yield url, model


@functools.lru_cache(maxsize=None)
def openai_client(url: str):
    """The official openai client of the server at ``url`` (thread-safe, keeps connections): one per server."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post_completion(url: str, body, **headers):
    """POST ``body`` (a dict, or bytes as they are) to /v1/completions as JSON; the httpx response."""
    import httpx

    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # json.dumps keeps \ud800 escaped
    return httpx.post(url + "/v1/completions", content=content, timeout=60,
                      headers={"Content-Type": "application/json", **headers})


def post_chat(url: str, body: dict):
    """POST ``body`` for the model "tiny" to /v1/chat/completions; the httpx response."""
    import httpx

    return httpx.post(url + "/v1/chat/completions", content=json.dumps({"model": "tiny", **body}).encode(),
                      headers={"Content-Type": "application/json"}, timeout=60)  # json.dumps keeps \ud800 escaped
@pytest.fixture(scope="session")
def small_text(tmp_path_factory) -> str:
    """200 KB of plain text (Tiny Shakespeare's first) in one .txt file, prepared with every default."""
    import gpt2lab
    from gpt2lab import cli

    root = tmp_path_factory.mktemp("small")
    asset = Path(gpt2lab.__file__).resolve().parent / "assets" / "tinyshakespeare.txt"
    (root / "small.txt").write_bytes(asset.read_bytes()[:200_000])
    assert cli.main(["prepare", "--source", str(root / "small.txt"), "--out", str(root / "data"), "--quiet"]) == 0
    return str(root / "data")
