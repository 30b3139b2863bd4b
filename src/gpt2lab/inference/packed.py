"""Prepacked CPU linears for batched decoding (the batching server's fp32 path).

A decode step multiplies a few rows (one per active request) by every weight. On CPUs, a
weight handed to ``F.linear`` as a plain tensor is (most likely: a GEMM packs its operands)
re-laid out by the BLAS on every call, and the small-M GEMM that follows runs far below the
machine's speed; oneDNN can reorder a
weight once into its own blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the
op torch.compile's CPU freezing uses) and multiply it with ``_linear_pointwise``. Measured
on a 2-core AVX2 EPYC (docs/benchmarks.md): the 768 x 50304 vocabulary projection takes
9.5 ms for 8 rows packed against 26.6 ms plain, and an 8-row step of the 124M model 47 ms
against 84-91 ms, while one row costs about the same.

Whether it pays is measured, not assumed: ``probe`` times both kernels on the model's own
largest weights at one row and at a full batch, and ``choose_linear`` (a pure function of
the request and those facts) keeps the plain kernel unless packed is faster at the full
batch and at most ``ONE_ROW_SLACK`` slower at one row. The values differ from ``F.linear``'s
in the last bits (another summation order), which is why ``--deterministic`` serving never
packs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

LINEAR_CHOICES = ("auto", "packed", "plain")

# How much slower than plain packed may be for one row and still be chosen. A one-row step reads
# every weight once and is bound by memory bandwidth under either kernel (their true one-row
# times are close), while the probe's one-row figures are a few ms and swing by 10-20% with
# scheduling on a busy machine; a batching server earns its keep at full batches, where packing
# saves up to half the step.
ONE_ROW_SLACK = 1.25


def packing_available() -> bool:
    """oneDNN is built in and exposes the reorder and the packed linear (torch >= 2.0 CPU builds)."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return bool(torch.backends.mkldnn.is_available() and ops is not None
                    and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held in oneDNN's layout (inference only: no gradients)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], batch_hint: int) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(), batch_hint)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@dataclass(frozen=True)
class LinearFacts:
    """What decides the kernel: the device, the compute dtype, the build, and the probe's times (ms)."""
    device_type: str
    dtype: str
    available: bool
    plain_ms: Optional[tuple[float, float]] = None   # (one row, full batch)
    packed_ms: Optional[tuple[float, float]] = None
    rows: int = 1


@dataclass(frozen=True)
class LinearChoice:
    value: str      # "packed" or "plain"
    reason: str


def _cannot_pack(facts: LinearFacts) -> Optional[str]:
    """Why the packed kernel cannot run with ``facts``, or None where it can."""
    if facts.device_type != "cpu":
        return f"{facts.device_type}: the device's own BLAS takes batches well"
    if facts.dtype != "float32":
        return f"dtype {facts.dtype}: the packed path is fp32"
    if not facts.available:
        return "this torch build has no oneDNN packed linear"
    return None


def choose_linear(requested: str, facts: LinearFacts) -> LinearChoice:
    """The decode kernel for the batching server's linears; ``packed`` only where it can run."""
    if requested not in LINEAR_CHOICES:
        raise ValueError(f"linear kernel {requested!r}: choose one of {', '.join(LINEAR_CHOICES)}")
    why_not = _cannot_pack(facts)
    if why_not:
        if requested == "packed":
            raise ValueError(f"--cpu-linear packed cannot run here ({why_not}); use auto or plain")
        return LinearChoice("plain", why_not)
    if requested != "auto":
        return LinearChoice(requested, "asked for")
    if facts.plain_ms is None or facts.packed_ms is None:
        return LinearChoice("plain", "not measured")
    (p1, pn), (k1, kn) = facts.plain_ms, facts.packed_ms
    times = (f"largest weights, 1 / {facts.rows} rows: packed {k1:.2f} / {kn:.2f} ms, "
             f"plain {p1:.2f} / {pn:.2f} ms")
    if kn < pn and k1 <= ONE_ROW_SLACK * p1:
        return LinearChoice("packed", f"measured faster ({times})")
    return LinearChoice("plain", f"packed measured no faster ({times})")


def _largest_linears(model: nn.Module, count: int = 2) -> list[nn.Linear]:
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return sorted(linears, key=lambda m: m.weight.numel(), reverse=True)[:count]


def probe(model: nn.Module, rows: int, repeats: int = 3) -> tuple[tuple[float, float], tuple[float, float]]:
    """Best-of-``repeats`` ms of the model's two largest linears, plain and packed, at 1 and ``rows`` rows."""
    layers = _largest_linears(model)
    packed = [PackedLinear(m.weight, m.bias, rows) for m in layers]

    def best(fns, m: int) -> float:
        xs = [torch.randn(m, layer.in_features) for layer in layers]
        times = []
        for _ in range(repeats + 1):  # the first call warms up
            start = time.perf_counter()
            for fn, x in zip(fns, xs):
                fn(x)
            times.append(time.perf_counter() - start)
        return 1e3 * min(times[1:])

    plain_fns = [lambda x, m=m: F.linear(x, m.weight, m.bias) for m in layers]
    with torch.inference_mode():
        plain = (best(plain_fns, 1), best(plain_fns, rows))
        pack = (best(packed, 1), best(packed, rows))
    return plain, pack


def decide(model: nn.Module, requested: str, device: torch.device, dtype: str, rows: int) -> LinearChoice:
    """Measure where it matters (auto, CPU fp32, oneDNN present) and choose."""
    facts = LinearFacts(device.type, dtype, packing_available(), rows=rows)
    if requested == "auto" and _cannot_pack(facts) is None:
        try:
            plain, packed = probe(model, rows)
        except RuntimeError as e:  # a oneDNN build that cannot reorder these weights: keep the plain kernel
            return LinearChoice("plain", f"the packed linear failed on this machine ({str(e).splitlines()[0]})")
        facts = LinearFacts(device.type, dtype, True, plain, packed, rows)
    return choose_linear(requested, facts)


def pack_linears(model: nn.Module, batch_hint: int) -> int:
    """Swap every ``nn.Linear`` of ``model`` for a ``PackedLinear`` (in place); returns how many.

    A tied output head gets its own packed copy (the embedding keeps the shared tensor); every
    other weight is held once, packed. The model is for inference from then on."""
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child.weight, child.bias, batch_hint))
    return len(swaps)
