"""gpt2lab bench sample: greedy decoding speed with and without the KV cache, vs transformers.

One random (seeded) GPT-2 is timed in the same process: gpt2lab with its KV cache (as
``gpt2lab sample`` runs it: on CPU with ``use_decode_layout``; also without it), gpt2lab
re-running the window every step, and transformers' GPT2LMHeadModel ``generate``
(use_cache=True, greedy) on the very same weights, exported with ``save_pretrained``.
Cached runs alternate so that a busy machine slows each alike; the best of ``--repeats``
is reported (plus every time).
"""
from __future__ import annotations

import argparse
import tempfile

import torch

from gpt2lab.benchmarks import timed
from gpt2lab.distributed.dist import DTYPES, autocast, pick_device
from gpt2lab.inference.generate import generate
from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.system.runtime import inference_dtype


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per run (exactly)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="length of the random prompt")
    p.add_argument("--device", default="auto", help="cpu, cuda, mps or auto (cuda > mps > cpu)")
    p.add_argument("--dtype", default="float32", choices=["auto", *sorted(DTYPES)],
                   help="autocast dtype for both libraries (float32: the figures in docs/benchmarks.md; "
                        "auto: what `gpt2lab sample` would use here)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each cached generator")
    p.add_argument("--no-cache-repeats", type=int, default=1, help="timed runs without the cache (slow; 0 skips)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice); 1 is steadier on a busy machine")


def _hf_model(model: GPT, device: torch.device):
    """transformers' GPT2LMHeadModel holding exactly ``model``'s weights (via an export)."""
    import transformers

    from gpt2lab.weights import hf as hf_io

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as d:
        hf_io.save_pretrained(model, d)
        return transformers.GPT2LMHeadModel.from_pretrained(d).to(device).eval()


def _first_mismatch(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Index of the first differing generated token, or None when the sequences agree."""
    if a.shape != b.shape:
        return min(a.size(1), b.size(1))
    diff = (a != b).any(dim=0).nonzero()
    return int(diff[0]) if len(diff) else None


def run(args: argparse.Namespace) -> dict:
    device = pick_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.dtype = inference_dtype(device, args.dtype, "bench sample")
    torch.manual_seed(args.seed)
    config = GPTConfig(block_size=args.block_size, vocab_size=args.vocab_size,
                       n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(config).to(device).eval()
    hf = _hf_model(model, device)
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt_tokens), device=device)
    n = args.new_tokens

    def ours(use_cache: bool) -> torch.Tensor:
        with autocast(device, args.dtype):
            return generate(model, prompt, n, temperature=0.0, use_cache=use_cache)[:, -n:]

    def theirs() -> torch.Tensor:
        with torch.inference_mode(), autocast(device, args.dtype):
            out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, use_cache=True,
                              pad_token_id=hf.config.eos_token_id)
        return out[:, -n:]

    # Warm-up: first calls pay for allocator growth and library set-up.
    with torch.inference_mode():
        generate(model, prompt, 4, temperature=0.0)
    theirs()
    times: dict[str, list[float]] = {"cache": [], "cache_plain_layout": [], "transformers": [], "no_cache": []}
    for _ in range(args.repeats):
        t, tok_plain = timed(lambda: ours(True), device)
        times["cache_plain_layout"].append(t)
        t, tok_hf = timed(theirs, device)
        times["transformers"].append(t)
        if device.type == "cpu":
            model.use_decode_layout()  # what `gpt2lab sample` does on CPU
        t, tok_cache = timed(lambda: ours(True), device)
        times["cache"].append(t)
        for p in model.parameters():  # back to the plain layout for the next round
            p.data = p.data.contiguous()
    tok_nocache = None
    for _ in range(args.no_cache_repeats):
        t, tok_nocache = timed(lambda: ours(False), device)
        times["no_cache"].append(t)
    return _report(args, device, times, tok_cache, tok_plain, tok_hf, tok_nocache)


def _report(args, device, times, tok_cache, tok_plain, tok_hf, tok_nocache) -> dict:
    n = args.new_tokens
    tps = {k: (n / min(v) if v else None) for k, v in times.items()}
    out = {
        "device": str(device),
        "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
        "config": dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, vocab_size=args.vocab_size),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": n,
        "tok_per_s_cache": tps["cache"],
        "tok_per_s_cache_plain_layout": tps["cache_plain_layout"],
        "tok_per_s_no_cache": tps["no_cache"],
        "tok_per_s_transformers_cache": tps["transformers"],
        "cache_speedup": tps["cache"] / tps["no_cache"] if tps["no_cache"] else None,
        "vs_transformers": tps["cache"] / tps["transformers"],
        "seconds": {k: [round(t, 3) for t in v] for k, v in times.items()},
        "first_mismatch_vs_transformers": _first_mismatch(tok_cache, tok_hf),
        "tokens_agree_with_transformers": _first_mismatch(tok_cache, tok_hf) is None,
    }
    out["tokens_agree_plain_vs_decode_layout"] = _first_mismatch(tok_cache, tok_plain) is None
    if tok_nocache is not None:
        out["tokens_agree_cache_vs_no_cache"] = _first_mismatch(tok_cache, tok_nocache) is None
    return out
