"""Shared tiny-model fixtures (CPU, seconds). Other areas may append fixtures at the end."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from gpt2lab.data.tokenizer import gpt2_tokenizer
from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.serve.limits import Limits
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
DATA = TESTS / "data"  # small fixtures: HellaSwag slice, text slices
ROOT = TESTS.parent  # the repository

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


# A shell's background job (`make test &` in a script) starts with SIGINT ignored, and every process the tests
# start would inherit that: their Ctrl-C tests would test nothing. This process takes Python's own Ctrl-C, as a
# run from a terminal has, and its children start with SIGINT at its default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _signals_as_found():
    """Each test finds SIGINT and SIGTERM as Python sets them (handlers, unblocked), whatever the test before it
    in this worker left: an in-process command that installs its own handler, or a blocked or ignored signal
    (which a child process inherits through exec), must not decide how a later test's Ctrl-C lands."""
    sigs = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.getsignal(s) for s in sigs}
    yield
    signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)
    for s, handler in before.items():
        if signal.getsignal(s) is not handler:
            signal.signal(s, handler)


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


def run_gpt2lab(
    *args: str, env: dict | None = None, timeout: float = 120, cwd: str | None = None
) -> subprocess.CompletedProcess:
    """``python -m gpt2lab ARGS`` in a fresh process (for exit codes and real stdout/stderr)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "gpt2lab", *args], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd
    )


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


@contextlib.contextmanager
def serving_in_thread(workers: dict, host: str = "127.0.0.1", connections=None) -> Iterator[str]:
    """Serve ``workers`` with uvicorn and their engine each in a background thread on a free port, the
    connections guarded as ``connections`` says (serve.limits.Connections); yield the base URL. The workers
    are closed on exit. (``gpt2lab serve`` runs the engine in its main thread instead, faster on CPUs:
    serve.server.serve_here, serve.jobs.run_engine's docstring; here serve_here runs in a thread, the
    test's body its client.)"""
    import queue
    import threading

    from gpt2lab.serve.connections import with_cap
    from gpt2lab.serve.server import bind, serve_here

    urls: queue.Queue = queue.Queue()
    done = threading.Event()

    def client(url: str) -> None:  # the server runs while the test does
        urls.put(url)
        done.wait()

    args = (workers, bind(host, 0), client)  # port 0: the OS picks
    capped = with_cap(connections) if connections is not None else None  # as gpt2lab serve resolves its flags
    server = threading.Thread(target=serve_here, args=args, kwargs={"connections": capped}, daemon=True)
    server.start()
    try:
        yield urls.get(timeout=60)
    finally:
        done.set()
        server.join(timeout=10)


@contextlib.contextmanager
def running_server(
    models: list[str],
    limits=None,
    deterministic: bool = False,
    linear: str = "packed",
    dtype: str = "float32",
    quantize: str = "none",
) -> Iterator[str]:
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
    return {
        (s.name, *sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


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
    return httpx.post(
        url + "/v1/completions", content=content, timeout=60, headers={"Content-Type": "application/json", **headers}
    )


def post_chat(url: str, body: dict):
    """POST ``body`` for the model "tiny" to /v1/chat/completions; the httpx response."""
    import httpx

    return httpx.post(
        url + "/v1/chat/completions",
        content=json.dumps({"model": "tiny", **body}).encode(),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )  # json.dumps keeps \ud800 escaped


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


# --- training: tiny shards, tiny configs, CLI runs in a subprocess

# A model small enough that a step takes milliseconds; the vocabulary stays GPT-2's (padded).
TINY = dict(
    n_layer=2,
    n_head=2,
    n_embd=32,
    block_size=32,
    seq_len=32,
    micro_batch_size=2,
    total_batch_tokens=128,
    max_steps=10,
    warmup_steps=3,
    max_lr=3e-3,
    min_lr=3e-4,
    dtype="float32",
    device="cpu",
    compile=False,
    seed=1234,
    eval_interval=0,
    hellaswag_interval=0,
    sample_interval=0,
    ckpt_interval=0,
    progress=False,
    keep_cpu_memory=False,
)  # in-process tests must not change the test process's allocator


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> str:
    """Tiny Shakespeare as token shards, made with the data package's own prepare()."""
    from gpt2lab.data.prepare import prepare

    out = tmp_path_factory.mktemp("shards") / "tinyshakespeare"
    prepare("tinyshakespeare", str(out), progress=False)
    return str(out)


def step_record(trainer) -> dict:
    """Run one step of a ``Trainer`` whose verdicts are read back every step (a CPU's); its record."""
    (done,) = trainer.train_step()
    return done.record


def cli_args(**fields) -> list[str]:
    """``--field value`` flags for ``gpt2lab train`` from TINY plus overrides."""
    args = []
    for key, value in {**TINY, **fields}.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        args += ["--" + key.replace("_", "-"), text]
    return args


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    src = str(ROOT / "src")
    e["PYTHONPATH"] = src + os.pathsep + e.get("PYTHONPATH", "")
    return e


def train_cmd(**fields) -> list[str]:
    return [sys.executable, "-m", "gpt2lab", "train", "--preset", "shakespeare-cpu", *cli_args(**fields)]


def run_train(resume: str | None = None, timeout: float = 120, **fields) -> subprocess.CompletedProcess:
    cmd = train_cmd(**fields) + (["--resume", resume] if resume else [])
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def records(run_dir) -> list[dict]:
    """Every record of a run's metrics.jsonl, in order."""
    return [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines() if line]


def torchrun_cmd(nproc: int = 2, **fields) -> list[str]:
    """`torchrun --standalone --nproc_per_node N -m gpt2lab train ...` for the tiny run."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "gpt2lab",
        *train_cmd(**fields)[3:],
    ]


def train_losses(run_dir: str) -> dict[int, float]:
    """step -> train_loss from a run's metrics.jsonl."""
    out = {}
    for line in Path(run_dir, "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "train_loss" in rec:
            out[rec["step"]] = rec["train_loss"]
    return out


@pytest.fixture(scope="session")
def finished_run(tiny_data, tmp_path_factory) -> Path:
    """A finished 4-step run with every evaluation on (for report tests); read-only.

    Made by the real CLI in this process (``cli.main`` with ``sys.argv`` as the console
    script would set it): a subprocess would cost a second torch import.
    """
    from unittest import mock

    from gpt2lab import cli

    out = tmp_path_factory.mktemp("finished") / "run"
    hellaswag = str(DATA / "hellaswag_val_200.jsonl")
    argv = [
        "train",
        "--preset",
        "shakespeare-cpu",
        *cli_args(
            data=tiny_data,
            out=str(out),
            max_steps=4,
            eval_interval=2,
            eval_tokens=128,
            hellaswag_interval=4,
            hellaswag_data=hellaswag,
            hellaswag_limit=4,
            sample_interval=2,
            sample_tokens=6,
            ckpt_interval=2,
            keep_checkpoints=0,
        ),
    ]
    with mock.patch.object(sys, "argv", ["/venv/bin/gpt2lab", *argv]):
        assert cli.main(argv) == 0
    return out


# --- references and helpers several test modules share


def reference_scores(model, examples) -> list[tuple[list[float], list[float]]]:
    """Plain loop: one row per (example, ending), no padding, transformers forward."""
    enc, out = gpt2_tokenizer(), []
    with torch.no_grad():
        for ex in examples:
            ctx = enc.encode(ex.ctx)
            sums, means = [], []
            for ending in ex.endings:
                end = enc.encode(" " + ending)
                hidden = model.transformer(torch.tensor([ctx + end])).last_hidden_state[0]
                # logits only where the next token is an ending token (the rest is unused)
                logp = torch.log_softmax(model.lm_head(hidden[len(ctx) - 1 : -1]), -1)
                losses = [-logp[j, t].item() for j, t in enumerate(end)]
                sums.append(sum(losses))
                means.append(sum(losses) / len(losses))
            out.append((sums, means))
    return out


def argmin(xs):
    return min(range(len(xs)), key=xs.__getitem__)


ALL_ON = dict(
    pos_emb="rotary",
    rope_theta=500.0,
    norm="rmsnorm",
    qk_norm=True,
    mlp_act="relu2",
    tie_embeddings=False,
    zero_init_proj=False,
    logit_softcap=12.0,
)


def reference_newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic iteration as the Muon write-up states it, in float64, no fused ops."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.t()
    x = x / torch.linalg.matrix_norm(x)  # Frobenius norm: every singular value <= 1
    for _ in range(steps):
        A = x @ x.t()
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    return x.t() if transposed else x


def saved_bytes(m: torch.nn.Module, run) -> int:
    """Bytes of every storage autograd keeps while ``run`` runs, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(n for ptr, n in saved.items() if ptr not in params)


def val_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in records(run_dir) if "val_loss" in r}


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, f"run ended (rc {proc.returncode}) before {path} appeared"
        assert time.time() < deadline, f"{path} did not appear"
        time.sleep(0.005)


def straight_and_killed(tmp_path, fields: dict, kill_after: str):
    """The run trained straight through into tmp_path/straight, and the same run kill -9'd once
    checkpoints/KILL_AFTER exists, in tmp_path/killed (returned)."""
    run_train(out=str(tmp_path / "straight"), **fields)
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        train_cmd(out=str(out), **fields), env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for(out / "checkpoints" / kill_after, proc)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    return out


def killed_then_resumed_equals_straight(tmp_path, fields: dict, kill_after: str):
    """Kill -9 a run after ``kill_after``, resume it; every step's loss equals the straight run's
    (to 1e-6: bit for bit on the same kernels and threads). Returns the resumed run's directory."""
    steps = fields["max_steps"]
    out = straight_and_killed(tmp_path, fields, kill_after)
    assert max(train_losses(out)) < steps - 1, "the run finished before it was killed"
    resumed = run_train(out=str(out), resume="auto", **fields)
    assert "resumed from" in resumed.stdout
    straight, again = train_losses(tmp_path / "straight"), train_losses(out)
    assert sorted(again) == list(range(steps))
    for step in range(steps):
        assert abs(again[step] - straight[step]) <= 1e-6, (step, again[step], straight[step])
    return out


def evaluate_loss(model, data_dir: str, **kwargs) -> float:
    """The mean validation loss ``gpt2lab eval loss`` reports (evals.loss.evaluate's ``loss``)."""
    from gpt2lab.evals.loss import evaluate

    return evaluate(model, data_dir, **kwargs).loss


def adapt_config(cfg):
    """``cfg`` with the architecture of its ``--init-from`` source, as the run plan takes it (each of cfg's
    values must agree with the source; a smaller block_size keeps its first positions)."""
    from gpt2lab.system.errors import ConfigError
    from gpt2lab.train.init_from import ARCH_FIELDS, InitFromError, check_arch, find_source

    arch = check_arch(find_source(cfg.finetune.init_from), {name: getattr(cfg.model, name) for name in ARCH_FIELDS})
    try:
        return cfg.with_values(model=arch)
    except ConfigError as e:
        sizes = ", ".join(f"{k} {v}" for k, v in arch.items())
        raise InitFromError(f"--init-from {cfg.finetune.init_from} ({sizes}): {e}") from e


# --- gpt2lab serve's connection guard (serve/connections.py, asgi.HostCheck): a server with its own
# Connections, and raw sockets against it


@contextlib.contextmanager
def guarded_server(model_dir: str, connections=None, host: str = "127.0.0.1") -> Iterator[str]:
    """The model in ``model_dir`` served as "tiny" on ``host`` (a free port) with ``connections``
    (serve.limits.Connections: head deadline, connection cap, Host names); yields the base URL."""
    pytest.importorskip("uvicorn", reason="gpt2lab serve needs the serve extra (fastapi, uvicorn)")
    from gpt2lab.inference.choice import InferenceRequest
    from gpt2lab.serve.models import load_workers

    workers = load_workers([f"tiny={model_dir}"], "cpu", InferenceRequest(dtype="float32", linear="packed"))
    with serving_in_thread(workers, host, connections) as url:
        yield url


def until_closed(socks: list, timeout: float) -> dict:
    """Read each socket until the server closes it (or resets it): {index: (time.monotonic() then,
    the bytes it sent)}; the sockets still open after ``timeout`` seconds are left out."""
    import selectors

    sel = selectors.DefaultSelector()
    got: dict = {}
    for i, s in enumerate(socks):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
        got[i] = b""
    closed: dict = {}
    deadline = time.monotonic() + timeout
    while len(closed) < len(socks) and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
            i = key.data
            try:
                data = key.fileobj.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except ConnectionResetError:
                data = b""
            if data:
                got[i] += data
            else:
                closed[i] = (time.monotonic(), got[i])
                sel.unregister(key.fileobj)
    sel.close()
    return closed
