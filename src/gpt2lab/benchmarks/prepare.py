"""gpt2lab bench prepare: `prepare` throughput (tokens/s) vs a single-process tiktoken loop.

The baseline is the plainest thing that does the same tokenizing: one process, the
documents already in memory, ``encode_ordinary`` on each. ``prepare`` is timed whole
(reading, tokenizing, writing shards and manifest), so the comparison favours the baseline.
Sources: the bundled Tiny Shakespeare (7,222 speeches) and WikiText-2 test, split into its
articles and written to a temporary .jsonl.
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
import time
from pathlib import Path

from gpt2lab.benchmarks import timed
from gpt2lab.data.prepare import prepare
from gpt2lab.data.sources import as_text, resolve_source
from gpt2lab.data.tokenizer import gpt2_tokenizer

WIKITEXT = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "wiki.test.raw"


def add_arguments(parser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="prepare workers (default 2)")
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs (default 3)")
    parser.add_argument("--wikitext", default=str(WIKITEXT), help="wiki.test.raw to benchmark")
    parser.add_argument("--scale", type=int, default=1, help="repeat each source's documents N times (steady state)")


def wikitext_articles(path: str) -> list[str]:
    """Split WikiText raw text at its top-level ' = Title = ' headings."""
    docs: list[str] = []
    for line in open(path, encoding="utf-8"):
        s = line.strip()
        if s.startswith("= ") and s.endswith(" =") and not s.startswith("= ="):
            docs.append("")
        if docs:
            docs[-1] += line
    return docs


def _cpu_s() -> float:
    """CPU seconds of this process and its reaped children (the tokenizer workers)."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def _best(fn, repeat: int) -> tuple[float, float]:
    """Best wall time of ``repeat`` runs, and the CPU time of that run."""

    def cpu_of_run() -> float:
        c0 = _cpu_s()
        fn()
        return _cpu_s() - c0

    return min(timed(cpu_of_run) for _ in range(repeat))


def _write_jsonl(path: str, docs: list[str]) -> str:
    Path(path).write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs), encoding="utf-8")
    return path


def _forked_encode(docs: list[str], workers: int) -> None:
    """The ceiling for `workers` processes: forked children each encode a share, no IPC."""
    enc = gpt2_tokenizer()
    pids = []
    for k in range(workers):
        pid = os.fork()
        if pid == 0:
            [enc.encode_ordinary(d) for d in docs[k::workers]]
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)


def _bench_source(name: str, source: str, workers: int, repeat: int, tmp: str) -> dict:
    docs = [as_text(d) for d in resolve_source(source).documents(0, None)]
    enc = gpt2_tokenizer()
    tokens = sum(len(enc.encode_ordinary(d)) + 1 for d in docs)  # + the EOT per document
    base, cpu = _best(lambda: [enc.encode_ordinary(d) for d in docs], repeat)
    result = {
        "documents": len(docs),
        "tokens": tokens,
        "baseline_tok_s": round(tokens / base),
        "baseline_cpu_s_per_mtok": round(cpu / tokens * 1e6, 3),
    }
    if hasattr(os, "fork"):  # how much parallelism the cores give right now (other load included)
        ceiling, _ = _best(lambda: _forked_encode(docs, workers), repeat)
        result[f"forked_w{workers}_ceiling_speedup"] = round(base / ceiling, 2)
    for w in sorted({1, workers}):
        runs = (os.path.join(tmp, f"{name}-{w}-{k}") for k in range(repeat))  # a fresh folder each run
        t, cpu = _best(lambda: prepare(source, next(runs), workers=w, progress=False), repeat)
        result[f"prepare_w{w}_tok_s"] = round(tokens / t)
        result[f"prepare_w{w}_cpu_s_per_mtok"] = round(cpu / tokens * 1e6, 3)
    result["speedup_vs_baseline"] = round(result[f"prepare_w{workers}_tok_s"] / result["baseline_tok_s"], 2)
    return result


def run(args) -> dict:
    out: dict = {k: getattr(args, k) for k in ("workers", "repeat", "scale")}
    out.update(cpu_count=os.cpu_count(), load_avg_1m_before=round(os.getloadavg()[0], 2))
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"tinyshakespeare": "tinyshakespeare"}
        if args.scale > 1:
            docs = list(resolve_source("tinyshakespeare").documents(0, None)) * args.scale
            sources["tinyshakespeare"] = _write_jsonl(os.path.join(tmp, "ts.jsonl"), docs)
        if os.path.exists(args.wikitext):
            docs = wikitext_articles(args.wikitext) * args.scale
            sources["wikitext2_test"] = _write_jsonl(os.path.join(tmp, "wt2.jsonl"), docs)
        else:
            out["wikitext2_test"] = f"skipped: {args.wikitext} not found"
        for name, src in sources.items():
            out[name] = _bench_source(name, src, args.workers, args.repeat, tmp)
    out["load_avg_1m_after"] = round(os.getloadavg()[0], 2)  # other work on the cores skews all of this
    return out
