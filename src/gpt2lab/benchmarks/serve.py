"""gpt2lab bench serve: tokens/s of `gpt2lab serve`, one stream and N concurrent streams.

A random (seeded) GPT-2 of the given shape is exported to a temporary HF directory and
loaded the way ``gpt2lab serve --model DIR`` loads it; the server runs in this process
(uvicorn in a thread) and is driven over HTTP with streamed ``/v1/completions`` requests,
each from its own client thread. Every request asks for exactly ``--new-tokens`` tokens
(a random model seldom draws <|endoftext|>; the token counts come from ``usage``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request

import torch

from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.weights import hf


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=64, help="tokens asked of each request")
    p.add_argument("--streams", type=int, default=8, help="concurrent requests in the second measurement")
    p.add_argument("--device", default="cpu", help="cpu, cuda, mps or auto")
    p.add_argument("--dtype", default="float32", help="autocast dtype of the server")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)


def _stream(url: str, seed: int, n: int) -> dict:
    """One streamed request: (seconds to first text, seconds in all, completion tokens)."""
    body = json.dumps({"model": "bench", "prompt": f"Request {seed}: the weather today is", "max_tokens": n,
                       "seed": seed, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0, first, tokens = time.perf_counter(), None, 0
    with urllib.request.urlopen(req, timeout=3600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event["choices"]:
                first = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return {"first_s": first, "total_s": time.perf_counter() - t0, "tokens": tokens}


def _concurrent(url: str, streams: int, n: int) -> tuple[float, list[dict]]:
    results: list = [None] * streams
    barrier = threading.Barrier(streams)

    def client(i: int) -> None:
        barrier.wait()
        results[i] = _stream(url, 100 + i, n)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, results


def run(args: argparse.Namespace) -> dict:
    from gpt2lab.serve.models import load_workers
    from gpt2lab.serve.api import serving_in_thread

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = GPTConfig(block_size=args.block_size, vocab_size=50257, n_layer=args.n_layer, n_head=args.n_head,
                       n_embd=args.n_embd)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(GPT(config), d)
        workers = load_workers([f"bench={d}"], args.device, args.dtype)
    n = args.new_tokens
    with serving_in_thread(workers) as url:
        _stream(url, 0, 4)  # warm-up: allocator growth, first-call set-up
        one = _stream(url, 1, n)
        wall, many = _concurrent(url, args.streams, n)
    total = sum(r["tokens"] for r in many)
    return {
        "device": args.device, "dtype": args.dtype, "torch_threads": torch.get_num_threads(),
        "config": dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, vocab_size=50257),
        "scheduling": "one worker thread per model; requests take turns token by token",
        "new_tokens": n,
        "one_stream_tok_per_s": one["tokens"] / one["total_s"],
        "one_stream_first_token_s": one["first_s"],
        "streams": args.streams,
        "aggregate_tok_per_s": total / wall,
        "per_stream_tok_per_s_mean": statistics.mean(r["tokens"] / r["total_s"] for r in many),
        "first_token_s_mean": statistics.mean(r["first_s"] for r in many),
        "first_token_s_max": max(r["first_s"] for r in many),
        "wall_s": wall, "tokens": total,
    }
