"""Where a one-row decode step's time goes on a GPU, per held copy of the model (gpu.sh's ``decode`` stage).

A bf16 decode step of the 124M shape was seen host-bound on an H200 (33-44 ms a step in some held
copies, 2.9 ms in others, 0.6 ms of GPU work). This times several fresh holds of each dtype, then, for
the slowest bf16 hold, the same steps with one thing changed at a time, and profiles it (the operators'
self CPU time, and Python's own profile of one step). One JSON line per measurement on stdout, the
profiles on stderr.

    python benchmarks/decode_stall.py [--holds 4] [--steps 50] [--variant NAME]

``--variant`` runs one variant alone (the driver runs ``no_lt`` in a process of its own, since PyTorch
reads ``DISABLE_ADDMM_CUDA_LT`` once).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys

import torch
import torch.nn.functional as F

from gpt2lab.benchmarks import timed
from gpt2lab.inference import kernels
from gpt2lab.inference.choice import Candidate
from gpt2lab.inference.form import hold
from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.system import runtime

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU only to check the script


PROMPT = 16


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def primed(model: GPT, length: int):
    """A one-row decode step of ``model`` after a 16-token prompt and a first step, in a cache of ``length``."""
    cache = model.new_kv_cache(length)
    model(torch.randint(0, 50257, (1, PROMPT), device=DEV), kv_cache=cache)
    tok = torch.randint(0, 50257, (1, 1), device=DEV)
    model(tok, kv_cache=cache, last_only=True)
    runtime.sync(DEV)
    return lambda: model(tok, kv_cache=cache, last_only=True)


@torch.inference_mode()
def step_ms(model: GPT, steps: int) -> dict:
    """Median and best of two timed loops of ``steps`` one-row steps after a 16-token prefill (ms a step);
    the caching allocator's cudaMalloc count over the loops."""
    step = primed(model, PROMPT + 3 * steps + 1)
    allocs = _allocs()
    out = [1e3 * timed(lambda: [step() for _ in range(steps)], DEV)[0] / steps for _ in range(2)]
    return {"ms": [round(x, 3) for x in out], "device_allocs": _allocs() - allocs}


def _allocs() -> int:
    return torch.cuda.memory_stats().get("num_device_alloc", 0) if DEV.type == "cuda" else 0


def profile(model: GPT, label: str) -> None:
    with torch.inference_mode():
        step = primed(model, 64)
        kinds = torch.profiler.ProfilerActivity
        acts = [kinds.CPU, *([kinds.CUDA] if DEV.type == "cuda" else [])]
        with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
            for _ in range(5):
                step()
            runtime.sync(DEV)
        print(f"== {label}: torch.profiler, 5 steps, by self CPU time", file=sys.stderr)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22), file=sys.stderr)
        by_shape = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=12)
        print(f"== {label}: by input shapes\n{by_shape}", file=sys.stderr)
        with cProfile.Profile() as pr:
            for _ in range(3):
                step()
            runtime.sync(DEV)
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    print(f"== {label}: cProfile, 3 steps, by own time\n{s.getvalue()}", file=sys.stderr, flush=True)


def no_bias_forward(self, x: torch.Tensor) -> torch.Tensor:  # F.linear without bias, then the add
    y = F.linear(x.to(self.dtype), self.weight)
    return y if self.bias is None else y + self.bias


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--holds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--variant", default="")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (to check the script on a CPU)")
    args = ap.parse_args()
    torch.manual_seed(0)
    shape = dict(n_layer=2, n_head=2, n_embd=64) if args.tiny else dict(n_layer=12, n_head=12, n_embd=768)
    base = GPT(GPTConfig(**shape, block_size=1024, vocab_size=50257)).to(DEV).eval()
    emit(device=torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu", torch=torch.__version__)
    if args.variant:  # one variant in a process of its own
        for i in range(args.holds):
            emit(variant=args.variant, hold=i, **step_ms(hold(base, Candidate("bfloat16", "plain")), args.steps))
        return
    slow = None
    for i in range(args.holds):
        for dt in ("bfloat16", "float32"):
            held = hold(base, Candidate(dt, "plain"))
            r = step_ms(held, args.steps)
            emit(dtype=dt, hold=i, **r)
            if dt == "bfloat16" and (slow is None or min(r["ms"]) > slow[0]):
                slow = (min(r["ms"]), held)
            del held
    held = slow[1]
    profile(held, f"slowest bf16 hold ({slow[0]:.2f} ms)")
    # one change at a time, on that same hold
    orig = kernels.DecodeLinear._plain
    kernels.DecodeLinear._plain = no_bias_forward
    emit(variant="linear without bias + add", **step_ms(held, args.steps))
    kernels.DecodeLinear._plain = orig
    emit(variant="the slowest hold again", **step_ms(held, args.steps))


if __name__ == "__main__":
    main()
