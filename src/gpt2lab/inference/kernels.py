"""The decode linears: one ``nn.Linear`` replacement per way of holding a weight for inference.

A model held for inference (inference/form.py) holds every matmul weight once, in the precision and
layout chosen for this machine, and never converts it again: no per-step autocast of fp32
weights. Each layer casts its input to its compute dtype and returns its output in that dtype;
the residual stream, the norms and the softmax stay fp32 (``fp32 + bf16`` is fp32), which is
what autocast computes, without re-reading and casting the weights at every step.

* ``plain``: ``F.linear`` on the weight as stored, (out, in) row-major;
* ``decode``: ``F.linear`` on the weight held column-major (the (in, out) layout of HF's
  Conv1D). Some BLAS GEMV paths stream it faster at one row (fp32 on Zen 4/5 and AVX2 EPYCs:
  the vocabulary projection ~1.7x), others slower (bf16 on the same Zen 5), hence measured;
* ``packed``: the weight reordered once into oneDNN's blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``, the op torch.compile's CPU freezing uses) and
  multiplied by ``_linear_pointwise``; fp32 or bf16. On CPUs this is the fastest small-M kernel
  by far where it runs (a 2-core Zen 5: the 768 x 50304 head at one row 3.6 ms packed fp32 vs
  9.0 plain; bf16 1.5 vs 2.5; docs/benchmarks.md);
* ``upcast``: half-precision weights (CPU) multiplied as held at one row (torch's half GEMV streams
  them at about fp32's bytes a second, so twice the weights a second), and at several rows in fp32,
  a slice of the weight at a time converted into a scratch buffer that stays in the cache and
  multiplied there. Where the CPU emulates half-precision matmuls (no AVX512_BF16: a 16-row bf16
  step 3-4x slower than fp32's on an AVX2 EPYC) the batch then costs about what an fp32 one does
  (on that EPYC 57 ms against fp32's 104 plain and 51 packed, for the 124M's linears at 16 rows),
  and the half-precision weights keep their one-row speed. Held for batches of several rows (the
  server's) where oneDNN packs, the weight's exact fp32 values are kept beside it, packed, in place of
  the slices (1.5x an fp32 model's memory): a batch then costs what a packed fp32 one does, where the
  conversion of every slice at every step would cost most at a few rows. The inputs are rounded to
  the weight's dtype, as at one row; the output of several rows stays fp32;
* ``gemv``: ``upcast`` with its one row, and a few more, multiplied by gpt2lab's compiled GEMV
  (``_gemv.c``): each bf16 weight row read once, widened to fp32 in AVX2 registers, products and sums
  in fp32, rows shared among the threads; on a CPU with native bf16 the inputs rounded to
  bf16 first, and where the kernel's AVX512_BF16 routines run the weights held in panels, every row
  count, a prompt's too, multiplied by their dot products (a panel hold). Where pip compiled it (a C
  compiler with OpenMP, Linux) and the CPU has AVX2 and FMA; elsewhere it is no candidate. On an AVX2
  EPYC it read a 768 x 3072 bf16 weight at 12-16 GB/s where torch's bf16 GEMV read 10;
* ``int8``: weight-only int8, symmetric per output channel (scale = max |w| / 127), multiplied
  by PyTorch's own ``torch._weight_int8pack_mm`` with activations in fp32 or bf16. Which one is
  measured: on the Zen 5 the kernel is 20x slower with fp32 activations than with bf16;
* ``int8-gemv``: the same int8 weights and scales multiplied by the compiled GEMV, with fp32
  activations; same conditions. On that EPYC it read the int8 weights at ~12 GB/s where
  ``_weight_int8pack_mm`` read 6-10 (bf16 activations) or ~1.3 (fp32).

Kernels are chosen by measuring them (probe.py), never by their names: torchao's int8
weight-only tensor, for one, dequantizes the whole weight on every eager call (25 ms for the
head at one row on that Zen 5, against 0.5 ms for ``_weight_int8pack_mm``).
"""

from __future__ import annotations

import functools
import hashlib
import threading
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

KERNELS = ("plain", "decode", "packed", "upcast", "gemv", "int8", "int8-gemv")


@functools.cache
def cannot_run(kernel: str, dtype=torch.float32, device=torch.device("cpu")) -> Optional[str]:
    """Why a ``kernel`` hold in ``dtype`` cannot run on ``device`` (the first line of the error it raises, tried
    on a tiny weight: oneDNN absent from the build, its bf16 reorder needing AVX512BW/VL/DQ or AVX-NE-CONVERT,
    no int8 weight-only kernel for the device), None where it runs."""
    try:
        with torch.no_grad():
            DecodeLinear(torch.ones(32, 32, device=device), None, kernel, dtype)(torch.ones(1, 32, device=device))
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        return str(e).splitlines()[0][:160] if str(e) else type(e).__name__
    return None


# The fp32 values of one slice of an upcast weight. Converted, then multiplied, it must still be in the
# cache: 4 MB fits the last-level cache of any x86 or Arm CPU of the last decade (>= 8 MB), and at
# 16 rows its matmul (~30 MFLOP) is long against the ~10 us a slice costs in Python. Not a tuning:
# the kernel is measured against the others, and slices from 0.5 to 4 MB timed within 10% of each
# other on an AVX2 EPYC (32 MB L3, 512 KB L2 a core).
UPCAST_SLICE = 1 << 20
_scratch = threading.local()  # one fp32 buffer of UPCAST_SLICE values a thread, shared by every layer


def _scratch_buffer(device: torch.device, n: int) -> torch.Tensor:
    """This thread's buffer of at least ``n`` fp32 values (UPCAST_SLICE, or one row of a wider weight)."""
    buf = getattr(_scratch, "buf", None)
    # one made under inference_mode cannot be written outside it (torch refuses): made again there
    stale = buf is not None and buf.is_inference() and not torch.is_inference_mode_enabled()
    if buf is None or stale or buf.device != device or buf.numel() < n:
        buf = _scratch.buf = torch.empty(max(n, UPCAST_SLICE), dtype=torch.float32, device=device)
    return buf


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, fp32 scale per output row): symmetric, ``w ~= q * scale`` with |q| <= 127."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


# torch 2.13's CPU _weight_int8pack_mm returns wrong values (and can crash) with bf16 activations
# when the inner dimension is not a multiple of 16 (seen on a Zen 5 for K = 8, 24, 40, 56, 100;
# 16, 32, 48, 64, 80, 96, 768, 3072 right). Zero columns change no product, so K is padded to a
# multiple of this (GPT-2's widths need none; tests/unit/test_kernels.py checks odd widths).
INT8_K_MULTIPLE = 64


try:  # gpt2lab's compiled kernel (``_gemv.c``), None where it was not built
    from gpt2lab.inference import _gemv
except ImportError:
    _gemv = None


@functools.cache
def compiled_build() -> str:
    """Which build of the compiled kernel this is (a hash of its file; "none" where it was not built): a
    figure measured with one build says nothing of another's speed."""
    try:
        with open(_gemv.__file__, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()[:16]
    except (AttributeError, OSError, TypeError):
        return "none"


def gemv_error(device: torch.device) -> Optional[str]:
    """Why gpt2lab's compiled GEMV (the ``gemv`` and ``int8-gemv`` kernels) cannot run on ``device``, or None
    where it can."""
    if device.type != "cpu":
        return f"gpt2lab's compiled GEMV is a CPU kernel, not {device.type}'s"
    if _gemv is None:
        return "gpt2lab's compiled GEMV was not built when gpt2lab was installed (it needs a C compiler with OpenMP)"
    if not _gemv.has_avx2():
        return "this CPU has no AVX2 and FMA, which gpt2lab's compiled GEMV needs to be faster than PyTorch's"
    return None


def _ptr(t: Optional[torch.Tensor]) -> int:
    """``t``'s address for the compiled kernel (0: None)."""
    return 0 if t is None else t.data_ptr()


def _compiled_gemv(
    name: str, x: torch.Tensor, w: torch.Tensor, scale, bias, n_out: int, round_inputs=False
) -> torch.Tensor:
    """``_gemv.<name>`` on ``x`` (..., in), as fp32: (..., n_out) fp32; ``scale``/``bias`` tensors or None;
    ``round_inputs`` (bf16 weights): ``x`` rounded to bf16 first."""
    x32 = x.reshape(-1, x.shape[-1]).float().contiguous()
    y = torch.empty(x32.size(0), n_out, dtype=torch.float32, device=x.device)
    if x32.size(0):
        getattr(_gemv, name)(
            x32.data_ptr(), w.data_ptr(), _ptr(scale), _ptr(bias), y.data_ptr(), x32.size(0), x32.size(1), n_out,
            torch.get_num_threads(), *((True,) if round_inputs else ()),
        )  # fmt: skip
    return y.reshape(*x.shape[:-1], n_out)


PANEL_OUT = 32  # _gemv.c's group of outputs: two 16-lane registers of fp32 sums


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 (out, in) weight in ``_gemv.c``'s panels: groups of PANEL_OUT outputs (the last padded with zero
    weights), each group's weights pair of inputs by pair, two panels of 16 outputs a pair, each output's two
    weights side by side: ``[group, in // 2, panel, output, 2]``. ``in`` must be even."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"panels hold an even number of inputs, not {k}")
    groups = -(-n // PANEL_OUT)
    w = F.pad(weight.to(torch.bfloat16), (0, 0, 0, groups * PANEL_OUT - n))
    return w.view(groups, 2, 16, k // 2, 2).permute(0, 3, 1, 2, 4).contiguous()


def panels_run(in_features: int) -> bool:
    """Whether a bf16 weight with inputs rounded to bf16 is held in panels here: the compiled kernel's
    AVX512_BF16 routines run (this CPU has them and the compiler knew them) and ``in_features`` is even."""
    return in_features % 2 == 0 and _gemv is not None and bool(_gemv.has_bf16_dot())


class DecodeLinear(nn.Module):
    """``y = x @ W.T + b`` for inference, the weight held once as ``kernel`` (one of KERNELS; module docstring)
    in ``dtype``: ``x`` is cast to ``dtype``, ``y`` stays in it (``upcast`` at several rows, ``gemv`` and
    ``int8-gemv``: fp32). ``batch_hint``: the rows oneDNN packs for (``packed``; ``upcast`` and ``gemv`` keep
    the weight's fp32 values packed beside it for several rows where oneDNN packs). ``bf16_inputs`` (``gemv``
    on a CPU that computes bf16 natively): every product's inputs rounded to bf16 first; the weight then in
    panels where the compiled kernel's AVX512_BF16 routines run and the width is even, every row count, a
    prompt's too, by their dot products (each output's sum in the same order whatever the rows, so a row's
    results are the same alone, in a batch, in a prompt and on any number of threads); else row-major, a
    prompt past the tiles by oneDNN's bf16 matmul, a server's batch past them upcast's fp32 matmul of the
    rounded inputs. ``gemv`` row-major multiplies up to ``tile_rows`` rows by its compiled tiles (the weights
    read once, widened to fp32 in registers; where they stop paying is the machine's: the probe measures it,
    choice.crossover), more rows as ``upcast``."""

    tile_rows = 1

    def __init__(self, weight, bias, kernel: str, dtype: torch.dtype, batch_hint=1, bf16_inputs=False) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel {kernel!r}: one of {', '.join(KERNELS)}")
        need = {"gemv": torch.bfloat16, "int8-gemv": torch.float32}.get(kernel, dtype)
        if dtype != need:
            raise ValueError(f"the {kernel} kernel runs in {str(need).removeprefix('torch.')} only, not {dtype}")
        self.out_features, self.in_features = weight.shape
        self.kernel, self.dtype, self.bf16_inputs = kernel, dtype, kernel == "gemv" and bf16_inputs
        self.round_inputs = kernel == "upcast" or self.bf16_inputs  # several rows: upcast's inputs rounded too
        self.bias = None if bias is None else bias.detach().to(dtype).contiguous()
        self.bias32 = None if bias is None else self.bias.float()  # the fp32 products' (upcast, compiled GEMV)
        self.weight = self.packed = self.panels = self.qweight = self.scale = None
        w, self.pad = weight.detach(), 0
        self.route = {"decode": "plain", "int8-gemv": "int8_gemv"}.get(kernel, kernel)
        if kernel in ("int8", "int8-gemv"):
            q, scale = quantize_int8(w)
            self.pad = -self.in_features % INT8_K_MULTIPLE if kernel == "int8" else 0
            self.qweight, self.scale = F.pad(q, (0, self.pad)).contiguous(), scale.to(dtype)
        elif kernel == "packed":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype).contiguous(), batch_hint)
        elif self.bf16_inputs and panels_run(self.in_features):
            self.panels, self.route = pack_panels(w), "panels"
        else:
            w = w.to(dtype)
            self.weight = w.t().contiguous().t() if kernel == "decode" else w.contiguous()
            self.slice_rows = max(1, UPCAST_SLICE // self.in_features)
            # upcast's fp32 copy packed for a batch; not made where a gemv hold's prompts take the bf16 matmul
            batch = batch_hint > 1 and not self.bf16_inputs and w.device.type == "cpu"
            if kernel in ("upcast", "gemv") and batch and cannot_run("packed") is None:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.float(), batch_hint)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"{self.kernel} {str(self.dtype).removeprefix('torch.')}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, "_" + self.route)(x)

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.dtype), self.weight, self.bias)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, self.bias, "none", [], "")

    def _upcast(self, x: torch.Tensor) -> torch.Tensor:
        """One row by ``F.linear`` as held; more in fp32, by the packed fp32 copy or a slice at a time."""
        x = x.to(self.dtype) if self.round_inputs else x
        lead, n = x.shape[:-1], x.numel() // self.in_features
        if n == 1:
            return F.linear(x, self.weight, self.bias)
        if n == 0:
            return x.new_empty(*lead, self.out_features, dtype=torch.float32)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.float(), self.packed, self.bias32, "none", [], "")
        xt = x.reshape(n, self.in_features).float().t()  # (in, n)
        out = torch.empty(self.out_features, n, dtype=torch.float32, device=x.device)  # y.T, filled a slice at a time
        buf = _scratch_buffer(x.device, self.slice_rows * self.in_features)
        for s in range(0, self.out_features, self.slice_rows):
            e = min(self.out_features, s + self.slice_rows)
            w = buf[: (e - s) * self.in_features].view(e - s, self.in_features)
            w.copy_(self.weight[s:e])
            torch.mm(w, xt, out=out[s:e])
        if self.bias32 is not None:
            out += self.bias32[:, None]
        return out.t().contiguous().reshape(*lead, self.out_features)  # fp32: rounding it costs a strided pass

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() // self.in_features
        if n > self.tile_rows and self.bf16_inputs and x.dim() > 2 and x.size(-2) > 1:  # a prompt's tokens
            return F.linear(x.to(torch.bfloat16), self.weight, self.bias).float()
        if n > self.tile_rows or n == 0:
            return self._upcast(x)
        return _compiled_gemv("bf16_gemv", x, self.weight, None, self.bias32, self.out_features, self.bf16_inputs)

    def _panels(self, x: torch.Tensor) -> torch.Tensor:
        return _compiled_gemv("panels_gemv", x, self.panels, None, self.bias32, self.out_features)

    def _int8(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features).to(self.dtype)
        y = torch._weight_int8pack_mm(F.pad(x, (0, self.pad)) if self.pad else x, self.qweight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def _int8_gemv(self, x: torch.Tensor) -> torch.Tensor:
        return _compiled_gemv("int8_gemv", x, self.qweight, self.scale, self.bias, self.out_features)


def tiled(model: nn.Module) -> list[DecodeLinear]:
    """``model``'s ``gemv`` linears whose rows past their ``tile_rows`` go to a matmul (row-major); a panel hold
    multiplies every row count by its own kernel."""
    return [m for m in model.modules() if isinstance(m, DecodeLinear) and m.route == "gemv"]


def set_tile_rows(model: nn.Module, rows: int) -> None:
    """Every ``gemv`` linear of ``model`` multiplies up to ``rows`` rows by its compiled tiles (at least 1)."""
    for m in tiled(model):
        m.tile_rows = max(1, int(rows))


def swap_linears(model: nn.Module, kernel: str, dtype: torch.dtype, batch_hint=1, bf16_inputs=False) -> int:
    """Replace every ``nn.Linear`` of ``model`` by its decode linear (in place); returns how many.

    A tied output head gets its own copy (the embedding keeps the shared table, looked up, not
    multiplied); every other weight is held once, in its new form."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    with torch.no_grad():
        for parent, name, child in swaps:
            setattr(parent, name, DecodeLinear(child.weight, child.bias, kernel, dtype, batch_hint, bf16_inputs))
    return len(swaps)
