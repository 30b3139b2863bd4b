"""The training loss without materialising the (B*T, vocab) logits: chunked, fused, exact.

``GPT.forward(idx, targets, return_logits=False)`` calls ``chunked_cross_entropy``; it
equals ``F.cross_entropy(x @ W.T, targets)`` (tests/unit/test_train_loss.py) and is faster and
smaller, because it never holds fp32 logits and computes both gradients in its forward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.nn import functional as F


# At GPT-2 sizes the vocabulary projection and its softmax dominate a CPU step: (B*T, 50304)
# logits in fp32 are ~400 MB for 2048 tokens, written and read several times by the plain
# path. Here rows are processed in chunks: the logits of a chunk stay in the compute dtype,
# one kernel turns them into the loss and d loss / d logits, and only grad_x (N, C) and
# grad_w (V, C) are kept for backward. Numerically it is ``F.cross_entropy(x @ W.T, targets)``
# (matmuls in the same dtype, softmax in fp32).
@dataclass(frozen=True)
class LossPath:
    """How ``GPT.forward`` computes the training loss (``GPT.set_loss``); ``choose_loss`` decides it."""

    chunked: bool = True  # chunked_cross_entropy, never holding the logits; False: logits + F.cross_entropy
    compiled: bool = False  # the chunked loss's per-chunk kernel through torch.compile
    reason: str = ""  # why, for the run plan's line

    @property
    def value(self) -> str:
        """The path's name as the run plan records it: "chunked" or "fused"."""
        return "chunked" if self.chunked else "fused"


def choose_loss(device_type: str, compiled: bool, sharded: bool = False) -> LossPath:
    """The loss path of a training run: the one rule, asked by the run plan, the memory planner and the
    memory benchmark (``compiled``: the model is compiled; ``sharded``: by FSDP across processes).

    A compiled model on a GPU: fused (logits + F.cross_entropy). Inductor fuses F.cross_entropy into
    the model's graph, while the chunked loss runs outside it (a custom autograd Function) as one
    kernel per chunk plus a concatenation: faster, for the memory of the bf16 logits the graph keeps
    (docs/benchmarks.md). Everywhere else chunked: on CPUs never holding the fp32 logits is faster;
    on eager GPUs F.cross_entropy would hold them in fp32. A model sharded by FSDP keeps the chunked
    loss regardless: the root, which computes the loss, is not compiled there (distributed.parallel.shard).
    """
    if sharded and compiled and device_type == "cuda":
        return LossPath(True, compiled, "FSDP: the loss runs in the uncompiled root, holding all logits eagerly")
    if compiled and device_type == "cuda":
        return LossPath(False, compiled, "compiled on CUDA: inductor fuses the cross-entropy into the model's graph")
    if device_type == "cpu":
        return LossPath(True, compiled, "CPU: never holding the fp32 logits measured faster")
    return LossPath(True, compiled, f"{device_type}, not compiled: F.cross_entropy would hold the logits in fp32")


# The chunk and group sizes are memory bounds, not speed tunings, which is why they hold on
# any machine: a chunk of 2^27 logits is a matmul of 2^28 * C FLOPs (50 GFLOP at C=192,
# 200 at C=768), far past the size where a CPU's or a GPU's GEMM reaches its full rate, so
# more or fewer chunks do not change the speed; what they bound is the transient memory
# (512 MB of fp32 logits a chunk at most), which fits every machine gpt2lab runs on. On a
# CPU the win is never holding fp32 logits, not cache reuse (docs/benchmarks.md).
_CHUNK_ELEMENTS = 2**27  # logits per chunk
_GROUP_ELEMENTS = 2**28  # logit gradients kept for one grad_w matmul (512 MB in bf16)


def _softmax_grad(
    logits: torch.Tensor, tgt: torch.Tensor, keep: torch.Tensor, scale: torch.Tensor, softcap: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """scale * (softmax - onehot) of one chunk in the logits' dtype, zero on ignored rows; summed nll.

    Written for torch.compile, which fuses it into one read of the logits and one write
    (the scale is free there; the eager version below leaves it to the caller). With a
    ``softcap`` the loss is that of softcap * tanh(logits / softcap), and the gradient is
    taken through the cap: d/dlogits = d/dcapped * (1 - tanh^2).
    """
    lf = logits.float()
    if softcap:
        t = torch.tanh(lf / softcap)
        lf = t * softcap
    lse = torch.logsumexp(lf, dim=-1, keepdim=True)
    hit = torch.arange(lf.shape[1], device=lf.device)[None, :] == tgt
    g = (torch.exp(lf - lse) - hit.float()) * scale
    if softcap:
        g = g * (1 - t * t)
    d = torch.where(keep[:, None], g, 0.0).to(logits.dtype)
    nll = lse.squeeze(1) - lf.gather(1, tgt).squeeze(1)
    return d, (nll * keep).sum()


def _softmax_grad_eager(
    logits: torch.Tensor, tgt: torch.Tensor, keep: torch.Tensor, scale: torch.Tensor | None = None, softcap: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """_softmax_grad without the scale (the caller applies it), in few eager kernels: one softmax, one cast."""
    dtype = logits.dtype
    if softcap:  # the capped logits in fp32, and the tanh kept for the gradient through the cap
        t = torch.tanh(logits.float() / softcap)
        logits = t * softcap
    p = torch.softmax(logits, dim=-1, dtype=torch.float32)
    pt = p.gather(1, tgt).squeeze(1)
    nll = -pt.clamp(min=torch.finfo(torch.float32).tiny).log()
    under = (pt == 0) & keep
    if bool(under.any()):  # a target below exp(-87) of its row: recompute those rows exactly
        lf = logits[under].float()
        nll[under] = torch.logsumexp(lf, dim=-1) - lf.gather(1, tgt[under]).squeeze(1)
    p.scatter_add_(1, tgt, torch.full_like(tgt, -1, dtype=p.dtype))
    if not bool(keep.all()):
        p[~keep] = 0.0
    if softcap:
        p.mul_(1 - t.square_())
    return p.to(dtype), (nll * keep).sum()


@functools.cache  # compiled once per process
def _kernel(compiled: bool):
    """(kernel, whether it applies the 1/n scale itself)."""
    return (torch.compile(_softmax_grad, dynamic=False), True) if compiled else (_softmax_grad_eager, False)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, compiled: bool, softcap: float
    ) -> torch.Tensor:
        cd = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            loss, grad_x, grad_w = _loss_and_grads(x.to(cd), weight.to(cd), targets, *_kernel(compiled), softcap)
        ctx.save_for_backward(grad_x.to(x.dtype), grad_w.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_out, grad_w * grad_out, None, None, None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _loss_and_grads(
    x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, kernel, kernel_scales: bool, softcap: float = 0.0
):
    """Mean loss, d/dx (N, C) and d/dw (V, C) in fp32; x and w already in the compute dtype.

    The 1/n of the mean is applied inside the compiled kernel, or else to the (N, C) and
    (V, C) results, never as a pass of its own over the (n, V) probabilities; grad_w is one
    matmul per group of chunks, not one per chunk.
    """
    N, V = x.shape[0], w.shape[0]
    keep = targets != -1
    inv_n = 1.0 / keep.sum().clamp(min=1).float()
    # fp16: 1/n applied before the cast would push most logit gradients below fp16's normal
    # range (p/65536 at B*T=65536), and GradScaler cannot help, its scale arriving only in backward
    kernel_scales = kernel_scales and x.dtype != torch.float16
    k_scale = inv_n if kernel_scales else torch.ones_like(inv_n)
    tgt = targets.clamp(min=0)[:, None]
    nll_sum = torch.zeros((), dtype=torch.float32, device=x.device)
    grad_x = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    grad_w = None
    # rows per chunk a power of two (equal chunks, one compile); a grad_w group a whole number of chunks
    rows = 1 << max(0, (_CHUNK_ELEMENTS // V).bit_length() - 1)
    group = max(rows, _GROUP_ELEMENTS // V // rows * rows)
    for g0 in range(0, N, group):
        g1, parts = min(N, g0 + group), []
        for s in range(g0, g1, rows):
            e = min(g1, s + rows)
            d, nll = kernel(x[s:e] @ w.t(), tgt[s:e], keep[s:e], k_scale, softcap)  # d: (n, V) d loss / d logits
            nll_sum += nll
            grad_x[s:e] = d @ w
            parts.append(d)
        d = parts[0] if len(parts) == 1 else torch.cat(parts)
        gw = (d.t() @ x[g0:g1]).float()
        grad_w = gw if grad_w is None else grad_w.add_(gw)
    if not kernel_scales:  # scaled here in fp32 (1/n is not exact in bf16), on the small results
        grad_x.mul_(inv_n)
        grad_w.mul_(inv_n)
    return nll_sum * inv_n, grad_x, grad_w


@torch.compiler.disable  # the model graph-breaks here; the loss runs as written (its kernel compiled or not)
def chunked_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, compiled: bool = False, softcap: float = 0.0
) -> torch.Tensor:
    """Mean cross entropy of ``x @ weight.T`` (N, V) against targets (N,), -1 ignored; with
    ``softcap`` > 0, of ``softcap * tanh(x @ weight.T / softcap)`` (GPTConfig.logit_softcap).

    ``compiled`` runs the per-chunk softmax gradient through torch.compile (one fused kernel).
    """
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(x, weight, targets, compiled, softcap)
    cd, total = _compute_dtype(x), torch.zeros((), dtype=torch.float32, device=x.device)
    rows = max(1, _CHUNK_ELEMENTS // weight.shape[0])
    with torch.autocast(x.device.type, enabled=False):
        wc = weight.to(cd)
        for s in range(0, x.shape[0], rows):  # evaluation: the same chunks, no gradient work
            logits = (x[s : s + rows].to(cd) @ wc.t()).float()
            if softcap:
                logits = softcap * torch.tanh(logits / softcap)
            total += F.cross_entropy(logits, targets[s : s + rows], ignore_index=-1, reduction="sum")
    return total / (targets != -1).sum().clamp(min=1)
