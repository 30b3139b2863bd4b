"""gpt2lab bench serve: `gpt2lab serve` under load, and under faults, on loopback only.

A random (seeded) GPT-2 of the given shape is exported to a temporary HF directory and
loaded and run the way ``gpt2lab serve --model DIR`` runs it (the model in this process's main
thread, uvicorn in another, bound to 127.0.0.1) and is driven over HTTP by clients in a process
of their own.

Load: for each count in ``--streams`` (e.g. 1,8,32), at most that many requests in flight (vLLM's
``--max-concurrency``), each a streamed ``/v1/completions`` request asking for exactly
``--new-tokens`` tokens (a random model seldom draws <|endoftext|>; counts come from ``usage``).
Without ``--request-rate`` the clients send back to back for ``--seconds`` (a closed loop: the
server's capacity at that concurrency); with ``--request-rate R`` requests arrive as a Poisson
process of R per second (seeded) for ``--seconds``, each waiting for a free slot when the cap is
reached (an open loop: what users at that rate feel). Reported per count, in the terms of vLLM's
``bench serve``: request and output-token throughput; TTFT (time to first token, from the request's
send to its first text), TPOT (time per output token after the first: (E2EL - TTFT) / (tokens - 1)),
ITL (the gaps between streamed chunks), E2EL (a request's whole time), each as mean, median (p50)
and p99 in milliseconds; requests and errors. ``aggregate_tok_per_s`` (all tokens / wall time) and
``per_stream_tok_per_s_mean`` (a request's tokens / its duration) as before. A table of these goes
to stderr; the JSON to stdout.

Fault run (``--fault``): clients that disconnect mid-stream, malformed JSON, oversize prompts
and bodies, and a burst of ``max_batch + max_queue + 8`` requests at once; every request must
get a result or a JSON error, the disconnected rows must be freed, the server must still
answer, and the process's RSS is read before and after.
"""

from __future__ import annotations

import argparse
import functools
import gc
import http.client
import itertools
import json
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Optional

import torch

from gpt2lab.benchmarks import add_shape_flags, machine, peers, rss_bytes, shape_config
from gpt2lab.inference.flags import add_inference_flags, inference_request
from gpt2lab.model.gpt import GPT
from gpt2lab.observe.plot import md_table
from gpt2lab.serve.limits import Limits, add_flags, from_flags
from gpt2lab.system.choices import finite_float
from gpt2lab.system.errors import UsageError

LATENCIES = ("ttft", "tpot", "itl", "e2el")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_shape_flags(p)
    p.add_argument("--new-tokens", type=int, default=64, help="tokens asked of each request")
    p.add_argument("--streams", default="1,8", help="comma-separated counts of requests in flight at most")
    p.add_argument("--seconds", type=finite_float, default=30.0, help="how long clients keep sending, per count")
    p.add_argument("--request-rate", type=finite_float, help="requests/s, Poisson arrivals (default: back to back)")
    p.add_argument("--device", default="auto", help="cpu, cuda, mps or auto (cuda > mps > cpu), as serve's")
    add_inference_flags(p)  # serve's flags and defaults: a default figure is a user's figure
    p.add_argument("--peer", default="none", help="ctranslate2: also time its batch of each stream count's rows")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    add_flags(p, Limits)  # serve's limits, as serve takes them
    p.add_argument("--deterministic", action="store_true", help="serve requests in turns (no batching)")
    p.add_argument("--fault", action="store_true", help="after the load, the fault run")


def _request(url: str, body: Optional[bytes], timeout: float = 600) -> tuple:
    """(connection, response) of a POST of ``body`` to /v1/completions, or of a GET of /metrics."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    headers = {"Content-Type": "application/json"}
    conn.request(*(("GET", "/metrics") if body is None else ("POST", "/v1/completions", body, headers)))
    return conn, conn.getresponse()


def _prompt(seed: int) -> str:
    return f"Request {seed}: the weather today is"


def _body(seed: int, n: int, stream: bool = True, prompt=None) -> bytes:
    body = {"model": "bench", "prompt": _prompt(seed) if prompt is None else prompt, "max_tokens": n, "seed": seed}
    return json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}} if stream else body).encode()


def _events(resp: http.client.HTTPResponse):
    """The parsed ``data:`` events of an SSE response, as they arrive."""
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def _stream(url: str, seed: int, n: int) -> dict:
    """One streamed request: time to first text, gaps between chunks, its tokens, and any error."""
    t0 = time.perf_counter()
    out = {"first_s": None, "gaps": [], "tokens": 0, "error": None}
    try:
        conn, resp = _request(url, _body(seed, n))
        if resp.status != 200:
            out["error"] = f"HTTP {resp.status}"
            return out
        last = None
        for event in _events(resp):
            now = time.perf_counter()
            if event.get("error"):
                out["error"] = event["error"]["message"]
            if event.get("choices") and event["choices"][0]["text"]:
                out["first_s"] = now - t0 if out["first_s"] is None else out["first_s"]
                if last is not None:
                    out["gaps"].append(now - last)
                last = now
            if event.get("usage"):
                out["tokens"] = event["usage"]["completion_tokens"]
        conn.close()
    except OSError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["total_s"] = time.perf_counter() - t0
    return out


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def _ms_stats(name: str, seconds: list[float]) -> dict:
    """mean, median and p99 of ``seconds`` in milliseconds, keyed as vLLM's bench serve names them."""
    stats = {"mean": statistics.mean, "median": lambda s: _percentile(s, 50), "p99": lambda s: _percentile(s, 99)}
    return {f"{k}_{name}_ms": 1000 * f(seconds) if seconds else None for k, f in stats.items()}


def arrivals(rate: float, seconds: float, seed: int) -> list[float]:
    """Poisson arrival times (exponential gaps of mean 1/rate) within ``seconds``, reproducible by seed."""
    import random

    gaps = iter(functools.partial(random.Random(seed).expovariate, rate), None)
    return list(itertools.takewhile(lambda t: t < seconds, itertools.accumulate(gaps)))


def summarize(done: list[dict], wall: float, streams: int, rate: Optional[float]) -> dict:
    """One load run's figures from its requests' records (see ``_stream``)."""
    ok = [r for r in done if r["error"] is None]
    tokens = sum(r["tokens"] for r in ok)
    firsts = [r["first_s"] for r in ok if r["first_s"] is not None]
    tpots = [
        (r["total_s"] - r["first_s"]) / (r["tokens"] - 1) for r in ok if r["first_s"] is not None and r["tokens"] > 1
    ]
    return {
        "streams": streams,
        "request_rate": rate,
        "requests": len(done),
        "errors": len(done) - len(ok),
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "request_throughput": len(ok) / wall,
        "aggregate_tok_per_s": tokens / wall,
        "per_stream_tok_per_s_mean": statistics.mean(r["tokens"] / r["total_s"] for r in ok) if ok else None,
        **_ms_stats("ttft", firsts),
        **_ms_stats("tpot", tpots),
        **_ms_stats("itl", [g for r in ok for g in r["gaps"]]),
        **_ms_stats("e2el", [r["total_s"] for r in ok]),
    }


def _together(fn, count: int) -> list:
    """``fn(0)`` ... ``fn(count - 1)``, each in a thread of its own, all at once: their results in order."""
    with ThreadPoolExecutor(max(count, 1)) as pool:
        return list(pool.map(fn, range(count)))


def load_test(url: str, streams: int, seconds: float, n: int, rate: Optional[float] = None, seed: int = 0) -> dict:
    """At most ``streams`` requests in flight for ``seconds``: back to back, or arriving at ``rate`` per second."""
    if rate is None:
        barrier = threading.Barrier(streams)

        def client(i: int) -> list[dict]:
            barrier.wait()
            end, done = time.perf_counter() + seconds, []
            while time.perf_counter() < end:
                done.append(_stream(url, 1000 * i + len(done), n))
            return done

        count = streams
    else:
        slots, times = threading.Semaphore(streams), arrivals(rate, seconds, seed)
        t_start = time.perf_counter() + 0.05

        def client(i: int) -> list[dict]:
            time.sleep(max(0.0, t_start + times[i] - time.perf_counter()))
            with slots:  # a request waits here for a slot; its clock starts when it is sent, as vLLM's
                return [_stream(url, i, n)]

        count = len(times)
    t0 = time.perf_counter()
    done = [r for rs in _together(client, count) for r in rs]
    return summarize(done, time.perf_counter() - t0, streams, rate)


def table(rows: list[dict]) -> str:
    """The load runs as a Markdown table: throughput, then TTFT / TPOT / ITL / E2EL median and p99 (ms)."""

    def f(v, digits=1):
        return "-" if v is None else f"{v:.{digits}f}"

    head = ["in flight", "rate req/s", "requests (errors)", "out tok/s"]
    head += [f"{m.upper()} p50 / p99 ms" for m in LATENCIES]
    body = [
        [r["streams"], "closed loop" if r["request_rate"] is None else f(r["request_rate"], 2)]
        + [f"{r['requests']} ({r['errors']})", f(r["aggregate_tok_per_s"])]
        + [f"{f(r[f'median_{m}_ms'])} / {f(r[f'p99_{m}_ms'])}" for m in LATENCIES]
        for r in rows
    ]
    return "\n".join(md_table([head, *body]))


def _rss_mb() -> float:
    gc.collect()
    return round(rss_bytes() / 2**20, 1)


def _answer(url: str, body: bytes) -> tuple[int, bool]:
    """(status, whether the body is a result or an OpenAI-shaped JSON error) of one request."""
    try:
        conn, resp = _request(url, body, timeout=120)
        data = resp.read()
        conn.close()
    except OSError:
        return 0, False
    try:
        parsed = json.loads(data)
    except ValueError:
        return resp.status, False
    return resp.status, ("choices" in parsed) if resp.status == 200 else isinstance(parsed.get("error"), dict)


def _active_rows(url: str) -> float:
    conn, resp = _request(url, None, timeout=30)
    text = resp.read().decode()
    conn.close()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("gpt2lab_active_rows{"))


def fault_run(url: str, limits: Limits, block_size: int, new_tokens: int, disconnects: int = 8) -> dict:
    """Faults against a running server; see the module's docstring. Every count is in the result."""
    out: dict = {"rss_before_mb": _rss_mb()}
    # clients that read two chunks of a long stream, then hang up
    long = min(block_size - 16, max(new_tokens, 32))
    for i in range(disconnects):
        conn, resp = _request(url, _body(500 + i, long))
        events = _events(resp)
        next(events), next(events)
        conn.sock.close()
        conn.close()
    deadline = time.monotonic() + 60
    while _active_rows(url) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    out["disconnected"] = disconnects
    out["rows_left_after_disconnects"] = _active_rows(url)
    bad = {
        "malformed_json": b'{"model": "bench", "prompt": ',
        "oversize_prompt": json.dumps({"model": "bench", "prompt": [1] * (block_size + 1)}).encode(),
        "oversize_body": json.dumps({"model": "bench", "prompt": "x" * (2 << 20)}).encode(),
        "max_tokens_past_cap": _body(0, limits.max_tokens + 1, stream=False, prompt="x"),
    }
    out.update({name: _answer(url, body)[0] for name, body in bad.items()})
    # a burst past the queue: every request answered, with a result or a JSON error
    burst = limits.max_batch + limits.max_queue + 8
    barrier = threading.Barrier(burst)

    def client(i: int) -> tuple[int, bool]:
        barrier.wait()
        return _answer(url, _body(i, new_tokens, stream=False, prompt=f"burst {i}"))

    answers = _together(client, burst)
    out["burst"] = burst
    out["burst_statuses"] = {str(s): sum(a[0] == s for a in answers) for s in sorted({a[0] for a in answers})}
    out["burst_unanswered"] = sum(1 for _, well_formed in answers if not well_formed)
    out["still_serving"] = _answer(url, _body(0, 2, stream=False, prompt="after"))[0]
    out["rss_after_mb"] = _rss_mb()
    return out


def run(args: argparse.Namespace) -> dict:
    from gpt2lab.serve.models import load_workers
    from gpt2lab.serve.server import bind, serve_here

    torch.manual_seed(args.seed)
    try:
        counts = [int(c) for c in str(args.streams).split(",") if c.strip()]
    except ValueError:
        counts = [0]
    if any(c < 1 for c in counts):
        raise UsageError(f"--streams {args.streams}: give whole counts of at least 1, comma-separated (e.g. 1,8,32)")
    if args.request_rate is not None and args.request_rate <= 0:
        raise UsageError(f"--request-rate {args.request_rate}: must be > 0 (leave it out for back-to-back requests)")
    limits = from_flags(Limits, args)
    wanted = peers.parse_peers(args.peer)
    if "transformers" in wanted:
        raise UsageError("--peer transformers: bench serve times CTranslate2 only (bench sample times both)")
    with tempfile.TemporaryDirectory() as d:
        hf_dir = peers.export(GPT(shape_config(args)), d)
        request = inference_request(args, "serve")
        workers = load_workers([f"bench={hf_dir}"], args.device, request, limits, args.deterministic)
        turns = "turns (--deterministic)" if args.deterministic else f"batches of up to {args.max_batch} rows"
        out = {
            **machine(workers["bench"].device, args, workers["bench"].decision),
            "scheduling": turns,
            **{k: getattr(args, k) for k in ("new_tokens", "seconds", "request_rate")},
        }

        def clients(url: str) -> None:
            _stream(url, 0, 4)  # warm-up: allocator growth, first-call set-up
            # the clients in a process of their own, as real clients are: client threads in the server's process
            # would take the interpreter lock from its event loop and worker (seen: 1 stream 57 vs 65 tok/s)
            with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
                load = (args.seconds, args.new_tokens, args.request_rate, args.seed)
                out["load"] = [pool.submit(load_test, url, n, *load).result() for n in counts]
            print(table(out["load"]), file=sys.stderr, flush=True)
            if args.fault:
                out["fault"] = fault_run(url, limits, args.block_size, args.new_tokens)

        serve_here(workers, bind("127.0.0.1", 0), clients)  # the model in this thread, as `gpt2lab serve` runs it
        if "ctranslate2" in wanted:  # an N-row batch for each stream count N: the clients' prompt, new tokens
            from gpt2lab.data.tokenizer import gpt2_tokenizer

            ct2 = peers.CT2(hf_dir, d, torch.get_num_threads())
            prompt = gpt2_tokenizer().encode(_prompt(0))
            out["ctranslate2"] = [
                {"rows": n, "aggregate_tok_per_s": ct2.tok_per_s(prompt, n, args.new_tokens, 3)} for n in counts
            ]
    return out
