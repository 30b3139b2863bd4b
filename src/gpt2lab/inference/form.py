"""A model held for inference: every linear in the chosen (dtype, kernel) form (kernels.py), the other
parameters shared with the model it came from.

``hold`` applies a choice; ``for_inference`` is the library's way to it (``gpt2lab.for_inference``): the
device's facts and inference/choice.py's rule, which needs no timing, so it prints nothing and writes
nothing; with ``dtype="auto"`` it takes the commands' measured choice where the probe cache holds one
for this model and machine (read, never written). The commands measure (inference/probe.py) and hold
their choice the same way.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from typing import Optional

import torch

from gpt2lab.inference import pages
from gpt2lab.inference.choice import (
    REQUEST_TOKENS,
    Candidate,
    InferenceRequest,
    Timing,
    candidates,
    choose,
    gemv_bf16_inputs,
)
from gpt2lab.inference.fused import HeldGPT
from gpt2lab.inference.kernels import cannot_run, compiled_build, gemv_error, panels_run, set_tile_rows, swap_linears
from gpt2lab.model.gpt import GPT
from gpt2lab.model.loss import LossPath
from gpt2lab.system import env, runtime

# On a CPU the attention of a held model runs in fp32, whatever its linears' dtype (its KV cache is then
# fp32 too). A decode step's attention reads a few MB at most; what it costs is the kernel: PyTorch's
# CPU attention at one query is several times slower in bf16 than in fp32 (an AVX2 EPYC, 12 heads of 64:
# 126-146 us against 26 at 144 keys, 860-3400 against 114 at 1024; docs/benchmarks.md).
CPU_ATTENTION_DTYPE = torch.float32


def detect_facts(device: torch.device) -> runtime.Facts:
    """The device's facts (system/runtime's ``detect``, no probe) with what the decode kernels can do here."""
    int8, gemv = cannot_run("int8", torch.float32, device), gemv_error(device)
    kernels = {
        "packed": cannot_run("packed") if device.type == "cpu" else f"{device.type} has no oneDNN",
        "int8": int8 and f"torch's int8 weight-only matmul does not run on {device.type} ({int8[:120]})",
        "gemv": gemv,
        "panels": gemv or (None if panels_run(2) else "no AVX512_BF16 routines"),
    }
    kernels["bfloat16/packed"] = kernels["packed"] or cannot_run("packed", torch.bfloat16)
    return dataclasses.replace(runtime.detect(device, probe=False), kernels=kernels)


def cache_key(config, device, names: list[str]) -> str:
    """The cache entry (system/runtime.py's cache) of a model (its GPTConfig) on ``device`` of this machine and
    this build of the compiled kernel, for these candidates."""
    shape = json.dumps(dataclasses.asdict(config), sort_keys=True)
    parts = [runtime.machine_key(), compiled_build(), str(device), shape, ",".join(sorted(names)), str(REQUEST_TOKENS)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def cached_timings(entry: Optional[dict], rows: Optional[int] = None) -> Optional[dict]:
    """An entry's reference figures (candidate name -> Timing, or -> why it was dropped) or, given ``rows``, its
    ``rows``-row step figures (name -> ms, or why dropped); None if it has none."""
    try:
        if rows is None:
            return {k: Timing(**v) if isinstance(v, dict) else str(v) for k, v in entry["timings"].items()}
        found = entry["rows"][str(rows)]["timings"].items()
        return {k: (float(v) if isinstance(v, (int, float)) else str(v)) for k, v in found}
    except (KeyError, TypeError, AttributeError):
        return None


def _shared_copy(model: GPT) -> GPT:
    """A copy of ``model``'s modules that shares every parameter, buffer and its tokenizer with it (the
    linears are swapped next)."""
    return copy.deepcopy(model, {id(t): t for t in (*model.parameters(), *model.buffers(), model.tokenizer)})


def hold(
    model: GPT, cand: Candidate, rows=1, inplace=False, tile_rows=1, bf16_inputs: Optional[bool] = None
) -> HeldGPT:
    """``model`` (or a copy sharing its other parameters) with every linear held as ``cand``, in a
    ``HeldGPT`` (``gemv``: up to ``tile_rows`` rows by its compiled tiles, a decision's ``tile_rows``;
    ``bf16_inputs``: every product's inputs rounded to bf16, by default where the device's facts say so:
    choice.gemv_bf16_inputs); for inference only."""
    target = model if inplace else _shared_copy(model)
    if bf16_inputs is None:
        facts = runtime.detect(next(model.parameters()).device, probe=False)
        bf16_inputs = cand.kernel == "gemv" and gemv_bf16_inputs(facts)
    swap_linears(target, cand.kernel, getattr(torch, cand.dtype), batch_hint=rows, bf16_inputs=bf16_inputs)
    set_tile_rows(target, tile_rows)
    target.eval()
    if inplace:  # a copy shares the model's other parameters: their requires_grad is the model's business
        target.requires_grad_(False)
    target.set_loss(LossPath(chunked=False))  # the chunked loss reads lm_head.weight, which a decode linear lacks
    if next(model.parameters()).device.type != "cpu":
        return HeldGPT(target).eval()
    # attention in fp32 (CPU_ATTENTION_DTYPE's note); the weights the hold made on huge pages where Linux gives
    # them (pages.py; the source model's own stay); GPT-2 held by the compiled GEMV: one call a step (fused.py)
    placed = pages.place(target, keep=[*model.parameters(), *target.parameters()])
    return HeldGPT(target, CPU_ATTENTION_DTYPE, placed).eval()


def for_inference(model: GPT, *, dtype: Optional[str] = None, quantize="none", linear="auto", rows=1) -> HeldGPT:
    """``gpt2lab.for_inference``: a copy of ``model`` (sharing its weights) held for generating ``rows`` rows
    on the device its parameters are on, in ``dtype`` (default: the model's own; "auto": the dtype the
    commands measured for this model shape on this machine, the same for ``sample``, ``serve`` and the
    evals, where gpt2lab's probe cache holds it, else the device's rule, half precision where the device
    computes it natively) or with int8 weights (``quantize="int8"``), the kernel likewise (``linear``:
    auto, plain or packed). No timing, no output, no files written: the choice is inference/choice.py's
    ``choose`` on the cached figures (``GPT2LAB_PROBE=0``: none) or its ``rule``. Greedy tokens at the
    model's own fp32 are those of the model as it is."""
    if not isinstance(model, GPT):
        raise TypeError(f"for_inference(model): a gpt2lab GPT, got {type(model).__name__}")
    device = next(model.parameters()).device
    dtype = dtype or str(next(model.parameters()).dtype).removeprefix("torch.")
    request = InferenceRequest(dtype=dtype, quantize=quantize, linear=linear, workload="sample", rows=rows)
    facts = detect_facts(device)
    if dtype == "auto" and env.probe_mode() != "0":
        names = [c.name for c in candidates(request, facts)]
        found = runtime.cached().get(cache_key(model.config, device, names))
        facts = dataclasses.replace(facts, timings=cached_timings(found))
    decision = choose(request, facts)
    return hold(model, decision.candidate, rows, tile_rows=decision.tile_rows)
