"""gpt2lab bench sample: one-row greedy decoding speed as users get it, beside the peers.

One random (seeded) GPT-2 of the given shape is timed in one process, every way alternating
within each round so that a busy machine slows each alike (best of ``--repeats`` reported,
every time kept):

* ``sample``: the model prepared exactly as ``gpt2lab sample`` prepares it with the same
  ``--dtype``/``--quantize``/``--cpu-linear`` (defaults: the command's, so a default figure is
  a user's figure; the decision and its measured candidates are in the output);
* ``generate``: the library's way, ``generate(for_inference(model, dtype=...), ...)`` asked for the
  same precision (the device's rule picks the kernel, with no timing: the same as ``sample`` where the
  measured pick agrees; ``generate_kernel`` in the output says which it held);
* ``unprepared``: ``generate`` on the model as it is, under autocast in that dtype, the path
  every command took before models were prepared (fp32 weights cast at every step);
* ``no_cache``: the prepared model re-running the whole window every step (``--no-cache-repeats``);
* peers (``--peer``, comma-separated): transformers' ``generate`` in the same float dtype, and
  CTranslate2 (fp32 and int8, and bf16 where it runs), converted from the same weights, same
  threads, same prompt, exactly as many new tokens;
* llama.cpp (``--llama-cpp PATH`` to a ``llama-bench`` build; CPU only): the same weights converted
  by llama.cpp's own converter to f32, f16, bf16 and q8_0, each timed by ``llama-bench`` generating
  as many tokens after a context of ``--prompt-tokens`` (``-d``), same threads, once in each of
  gpt2lab's rounds, right after it (the best of its rounds reported, like gpt2lab's: a machine whose
  speed drifts over minutes moves both alike). Its figure counts decoding only, so beside gpt2lab's
  whole figure (the prompt read included) the output has ``sample``'s decoding alone
  (``decode_tok_per_s``: the n - 1 steps from its first new token to its last, in the same timed
  runs) and both ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import torch

from gpt2lab.benchmarks import add_shape_flags, machine, peers, rounds, shape_config
from gpt2lab.distributed.dist import autocast, pick_device
from gpt2lab.inference.choice import InferenceRequest, candidates, rule, tile_rows_of
from gpt2lab.inference.flags import add_inference_flags, inference_request
from gpt2lab.inference.form import detect_facts, for_inference, hold
from gpt2lab.inference.probe import announce, decide
from gpt2lab.model.gpt import GPT
from gpt2lab.model.sampling import generate, generate_stream
from gpt2lab.system import runtime
from gpt2lab.system.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_shape_flags(p, vocab=True)
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per run (exactly)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="length of the random prompt")
    p.add_argument("--device", default="auto", help="cpu, cuda, mps or auto (cuda > mps > cpu)")
    add_inference_flags(p)
    p.add_argument("--peer", default="transformers", help="transformers, ctranslate2 or none, comma-separated")
    p.add_argument("--ways", default="sample,generate,unprepared", help="sample (always), generate, unprepared")
    p.add_argument("--all-settings", action="store_true", help="also every explicit (dtype, kernel) this device runs")
    p.add_argument("--llama-cpp", metavar="PATH", help="a llama.cpp build's llama-bench, timed beside gpt2lab (CPU)")
    p.add_argument("--llama-cpp-convert", metavar="PATH", help="convert_hf_to_gguf.py (default: the llama.cpp tree's)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds")
    p.add_argument("--no-cache-repeats", type=int, default=1, help="timed runs without the cache (slow; 0 skips)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch (and CTranslate2) CPU threads (default: torch's choice)")


def first_mismatch(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Index of the first differing generated token, or None when the sequences agree."""
    if a.shape != b.shape:
        return min(a.size(1), b.size(1))
    diff = (a != b).any(dim=0).nonzero()
    return int(diff[0]) if len(diff) else None


def run(args: argparse.Namespace) -> dict:
    device = pick_device(args.device)
    wanted = peers.parse_peers(args.peer)
    torch.manual_seed(args.seed)
    model = GPT(shape_config(args)).to(device).eval()
    request = inference_request(args, "sample")
    decision = decide(model, device, request, command="bench sample")
    prepared = hold(model, decision.candidate, request.rows, tile_rows=decision.tile_rows)
    announce(decision, "bench sample")
    dtype = decision.candidate.dtype  # the float dtype of every float comparison (int8's activations)
    library = for_inference(model, dtype=dtype, quantize=args.quantize)  # what a Python user's call holds
    library_pick = rule(InferenceRequest(dtype=dtype, quantize=args.quantize), detect_facts(device)).candidate
    prompt = torch.randint(0, args.vocab_size, (1, args.prompt_tokens), device=device)
    n = args.new_tokens

    def greedy(m, **kw):
        return lambda: generate(m, prompt, n, temperature=0.0, **kw)[:, -n:]

    spans: list[tuple[float, float]] = []  # sample's (first new token, last) times, each timed run
    ways = {
        "sample": lambda: _decoding(prepared, prompt, n, device, spans),
        "generate": greedy(library),
        "unprepared": lambda: _unprepared(model, prompt, n, device, dtype),
    }
    asked = {w.strip() for w in args.ways.split(",") if w.strip()} | {"sample"}
    if asked - set(ways):
        raise UsageError(f"--ways {args.ways}: choose from {', '.join(ways)}")
    ways = {k: v for k, v in ways.items() if k in asked}
    if args.all_settings:  # every explicit setting the device runs, each held as it would be
        for cand in candidates(dataclasses.replace(request, dtype="auto", linear="auto"), detect_facts(device)):
            tiles = tile_rows_of((decision.timings or {}).get(cand.name))  # its own, where measured
            ways[f"setting {cand.name}"] = greedy(hold(model, cand, request.rows, tile_rows=tiles))
    if args.llama_cpp and device.type != "cpu":
        raise UsageError(f"--llama-cpp: llama.cpp is timed on the CPU only (device {device}); add --device cpu")
    threads, llama_rounds = torch.get_num_threads(), []
    with tempfile.TemporaryDirectory() as d:
        hf_dir = peers.export(model, d) if wanted or args.llama_cpp else None
        llama = peers.LlamaCpp(args.llama_cpp, hf_dir, d, threads, args.llama_cpp_convert) if args.llama_cpp else None
        if "transformers" in wanted:
            ways["transformers"] = peers.transformers_greedy(hf_dir, device, dtype, prompt, n)
        ct2 = peers.CT2(hf_dir, d, threads) if "ctranslate2" in wanted and device.type == "cpu" else None
        for fn in ways.values():  # warm-up: allocator growth, library set-up
            with torch.inference_mode():
                fn()
        spans.clear()
        # llama.cpp in the same rounds: the box's drift over minutes falls on both alike
        after = (lambda: llama_rounds.append(llama.tok_per_s(args.prompt_tokens, n, 1))) if llama else None
        times, tokens = rounds(ways, args.repeats, device, after)
        no_cache, last = rounds({"no_cache": greedy(prepared, use_cache=False)}, args.no_cache_repeats, device)
        times, tokens = {**times, **no_cache}, {**tokens, **last}
        ct2_tps = ct2.tok_per_s(prompt[0].tolist(), 1, n, args.repeats) if ct2 else None
        ct2_agree = None
        if ct2 and "float32" in ct2.generators:
            ct2_tokens = torch.tensor([ct2.greedy("float32", prompt[0].tolist(), 1, n)[0]])
            ct2_agree = first_mismatch(ct2_tokens, tokens["sample"].cpu())
    tps = {k: (n / min(v) if v else None) for k, v in times.items()}
    out = {
        **machine(device, args, decision),
        **{k: getattr(args, k) for k in ("prompt_tokens", "new_tokens")},
        "tok_per_s": tps,
        "seconds": {k: [round(t, 3) for t in v] for k, v in times.items()},
        "cache_speedup": tps["sample"] / tps["no_cache"] if tps["no_cache"] else None,
    }
    if "generate" in tps:
        out["generate_kernel"] = library_pick.name
        out["generate_vs_sample"] = tps["generate"] / tps["sample"]
        out["tokens_agree_generate_vs_sample"] = first_mismatch(tokens["generate"], tokens["sample"]) is None
    if "unprepared" in tps:
        out["sample_vs_unprepared"] = tps["sample"] / tps["unprepared"]
    settings = {k.removeprefix("setting "): v for k, v in tps.items() if k.startswith("setting ")}
    if settings:
        out["best_setting"] = best = max(settings, key=settings.get)
        out["sample_vs_best_setting"] = tps["sample"] / settings[best]
    if tps["no_cache"]:
        out["tokens_agree_cache_vs_no_cache"] = first_mismatch(tokens["sample"], tokens["no_cache"]) is None
    if "transformers" in tps:
        out["vs_transformers"] = tps["sample"] / tps["transformers"]
        out["first_mismatch_vs_transformers"] = first_mismatch(tokens["sample"], tokens["transformers"])
    if ct2_tps is not None:
        out["ctranslate2_tok_per_s"] = ct2_tps
        out["vs_ctranslate2"] = peers.ratios(tps["sample"], ct2_tps)
        out["first_mismatch_vs_ctranslate2_float32"] = ct2_agree
    elif "ctranslate2" in wanted:
        out["ctranslate2_tok_per_s"] = f"not run: CTranslate2 is timed on the CPU only (device {device})"
    if prepared.held_pages is not None:  # where the held weights live (inference/pages.py)
        out["held_pages"] = prepared.held_pages.describe()
    decoding = max(((n - 1) / (t1 - t0) for t0, t1 in spans if t1 > t0), default=None) if n > 1 else None
    out["decode_tok_per_s"] = {"sample": decoding}
    if llama:
        out["llama_cpp_tok_per_s"] = llama_tps = peers.best_rounds(llama_rounds)
        out["llama_cpp_rounds"] = llama_rounds  # each round's, beside gpt2lab's ``seconds`` of the same rounds
        out["vs_llama_cpp"] = peers.ratios(tps["sample"], llama_tps)
        if decoding:
            out["decoding_vs_llama_cpp"] = peers.ratios(decoding, llama_tps)
    return out


def _decoding(model, prompt: torch.Tensor, n: int, device: torch.device, spans: list) -> torch.Tensor:
    """``generate``'s n new tokens (1, n), from the same loop, keeping the times of the first and the last in
    ``spans``: between them the model decodes alone, n - 1 steps, as llama-bench's generation figure counts."""
    new, first = [], None
    for tok, _ in generate_stream(model, prompt, n, temperature=0.0):
        runtime.sync(device)
        new.append(tok[:, None])
        first = first or time.perf_counter()
    spans.append((first, time.perf_counter()))
    return torch.cat(new, dim=1)


def _unprepared(model: GPT, prompt: torch.Tensor, n: int, device: torch.device, dtype: str) -> torch.Tensor:
    with autocast(device, dtype):
        return generate(model, prompt, n, temperature=0.0)[:, -n:]
