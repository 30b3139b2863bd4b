"""A model held for inference: every linear in the chosen (dtype, kernel) form (kernels.py), the other
parameters shared with the model it came from.

``hold`` applies a choice; ``for_inference`` is the library's way to it (``gpt2lab.for_inference``): the
device's facts and inference/choice.py's rule, which needs no timing, so it prints nothing and writes
nothing. The commands measure instead (inference/probe.py) and hold their measured choice the same way.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

from gpt2lab.inference.choice import Candidate, InferenceFacts, InferenceRequest, rule
from gpt2lab.inference.kernels import int8_available, packing_available, packing_bf16_error, swap_linears
from gpt2lab.model.gpt import GPT
from gpt2lab.model.loss import LossPath
from gpt2lab.system import runtime


def detect_facts(device: torch.device) -> InferenceFacts:
    """The device's facts the choice depends on (no timing: system/runtime's flags, what oneDNN and int8 can do)."""
    f = runtime.detect(device, probe=False)
    return InferenceFacts(
        device.type,
        f.device_name,
        native_bf16=f.native_bf16,
        packing=(packing := device.type == "cpu" and packing_available()),
        packing_bf16_error=packing_bf16_error() if packing else None,
        int8_error=int8_available(device),
    )


def _shared_copy(model: GPT) -> GPT:
    """A copy of ``model``'s modules that shares every parameter, buffer and its tokenizer with it (the
    linears are swapped next)."""
    memo = {id(p): p for p in model.parameters()}
    memo.update({id(b): b for b in model.buffers()})
    memo[id(model.tokenizer)] = model.tokenizer
    return copy.deepcopy(model, memo)


def hold(model: GPT, cand: Candidate, rows: int = 1, inplace: bool = False) -> GPT:
    """``model`` (or a copy sharing its other parameters) with every linear held as ``cand``; for inference only."""
    target = model if inplace else _shared_copy(model)
    swap_linears(target, cand.kernel, getattr(torch, cand.dtype), batch_hint=rows)
    target.eval()
    if inplace:  # a copy shares the model's other parameters: their requires_grad is the model's business
        target.requires_grad_(False)
    target.set_loss(LossPath(chunked=False))  # the chunked loss reads lm_head.weight, which a decode linear lacks
    return target


def for_inference(
    model: GPT, *, dtype: Optional[str] = None, quantize: str = "none", linear: str = "auto", rows: int = 1
) -> GPT:
    """``gpt2lab.for_inference``: a copy of ``model`` (sharing its weights) held for generating ``rows`` rows
    on the device its parameters are on, in ``dtype`` (default: the model's own; "auto": the device's rule,
    half precision where the device computes it natively) or with int8 weights (``quantize="int8"``), the
    kernel by the device's rule (``linear``: auto, plain or packed). No timing, no output, no files: the
    rule's choice is inference/choice.py's ``rule``; to take exactly what ``gpt2lab sample`` measured, pass
    the dtype and kernel it printed. Greedy tokens at the model's own fp32 are those of the model as it is."""
    if not isinstance(model, GPT):
        raise TypeError(f"for_inference(model): a gpt2lab GPT, got {type(model).__name__}")
    device = next(model.parameters()).device
    dtype = dtype or str(next(model.parameters()).dtype).removeprefix("torch.")
    request = InferenceRequest(dtype=dtype, quantize=quantize, linear=linear, workload="sample", rows=rows)
    return hold(model, rule(request, detect_facts(device)).candidate, rows)
