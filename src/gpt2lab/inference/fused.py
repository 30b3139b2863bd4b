"""A model held for inference (``HeldGPT``), and its fused decode step: a GPT-2 held with gpt2lab's compiled
GEMV runs a new token in one call.

At one row a decode step's linears read the weights once (kernels.py's ``gemv`` and ``int8-gemv``);
what is left is ~25 small operators a block (two LayerNorms, the q/k/v split and cast, the KV-cache
writes, attention, GELU, two residual adds), ~300 us of dispatch and Python a block on a 2-core EPYC,
~3-4 ms a token, a fifth of the step; and each kernel call wakes the threads again.
``_gemv.model_step`` (``_gemv.c``) runs the whole step in one OpenMP region: the token's and position's
embeddings, every block, the final norm and the head, at any rows the head by the same compiled products
as the blocks' linears (a bf16 head's own forward takes several rows through PyTorch's packed fp32 copy,
which reads twice the bytes: on a 2-core AVX2 EPYC the 124M's 4-row step 20% and 8-row step 8% faster in
C, the 16-row step within 3%; the probe times the server's batch step with it, as with every kernel):
the same weights as held, the same fp32 activations, norms, softmax and KV cache; only the order of the
sums differs (and exp, in GELU and the softmax, is the kernel's own, within ~1 ulp of the C library's).
Its rows need not be one token of each cache slot: ``HeldGPT.step_rows`` gives each row a slot and a
position and asks for the logits of some rows only, and every row's key and value are written before
any row attends, so a prompt's tokens run as rows beside the other rows' next tokens (the server's mixed
step, serve/batch.py).

A held network whose structure the step computes (GPT-2's: LayerNorm, learned positions, tanh GELU, no
q/k norm, no value embeddings, every linear and the head held by one of those kernels, fp32 norms and
attention) takes it for the calls it covers: one new token a row, no gradient, a cache already holding
the prompt in fp32 (slots, heads, positions, head size) buffers, row i in slot i at the cache's position
for it (``positions``: one for all rows in a ``KVCache``, each its own in the server's ``RowsCache``).
Every other call, and every other network (the modern block), runs the network's own code.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn as nn

from gpt2lab.inference.kernels import DecodeLinear, _gemv, _ptr, tiled
from gpt2lab.model.gpt import GPT, Block, KVCache
from gpt2lab.model.sampling import generate, plan_free_attention


def _held_tensors(m: DecodeLinear) -> tuple:
    """(weight, scale, bias) tensors of a compiled-GEMV linear (None: none)."""
    if m.route == "int8_gemv":
        return m.qweight, m.scale, m.bias
    return (m.weight if m.panels is None else m.panels), None, m.bias32


def _kind(m: nn.Module) -> Optional[int]:
    """``_gemv.c``'s code for what a compiled-GEMV linear holds: 0 int8, 1 bf16, 2 bf16 whose inputs are
    rounded to bf16 (``bf16_inputs``), 3 that in panels; None: not a compiled-GEMV linear."""
    if not isinstance(m, DecodeLinear):
        return None
    return {"int8_gemv": 0, "gemv": 1 + m.bf16_inputs, "panels": 3}.get(m.route)


def _kv_fits(k, v, rows: int, n_head: int, width: int) -> bool:
    """Whether a layer's cached keys and values are buffers the kernel reads: fp32 on the CPU, contiguous,
    (slots >= rows, heads, positions, head size)."""
    if k is None or v is None or k.shape != v.shape or k.dim() != 4:
        return False
    fp32 = all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in (k, v))
    return fp32 and k.shape[0] >= rows and k.shape[1] == n_head and k.shape[3] * n_head == width


def _fp32_layernorm(n: nn.Module) -> bool:
    fp32 = all(t is None or t.dtype == torch.float32 for t in (getattr(n, "weight", None), getattr(n, "bias", None)))
    return type(n) is nn.LayerNorm and n.weight is not None and fp32


def fusable(block: nn.Module) -> bool:
    """Whether ``_gemv.model_step`` computes ``block`` (structure, kernels and dtypes; not the call)."""
    if not isinstance(block, Block):
        return False
    attn, mlp = block.attn, block.mlp
    kinds = {_kind(m) for m in (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)}
    if attn.qk_norm or hasattr(attn, "ve_gate") or len(kinds) != 1 or None in kinds:
        return False
    gelu = isinstance(mlp.act, nn.GELU) and mlp.act.approximate == "tanh"
    return gelu and _fp32_layernorm(block.ln_1) and _fp32_layernorm(block.ln_2) and block.ln_1.eps == block.ln_2.eps


def whole_step_fusable(model: GPT) -> bool:
    """Whether ``_gemv.model_step`` computes ``model``'s step: GPT-2's structure, every block ``fusable``."""
    c, blocks, ln_f = model.config, model.transformer.h, model.transformer.ln_f
    gpt2 = c.pos_emb == "learned" and not (c.embed_norm or c.value_embeds or c.unet_skips or c.logit_softcap)
    one = len({b.ln_1.eps for b in blocks}) == len({_kind(b.attn.c_attn) for b in blocks}) == 1  # one eps, one kind
    blocks_ok = all(fusable(b) for b in blocks) and one
    head_ok = type(ln_f) is nn.LayerNorm and ln_f.weight is not None and _kind(model.lm_head) is not None
    return gpt2 and blocks_ok and head_ok


class _StepPlan:
    """What ``_gemv.model_step`` reads of a held network, gathered once: looking the tensors up through the
    modules costs ~1 ms a step, reading the addresses and dtypes of the tensors themselves ~50 us. Made again
    after the model is cast or moved (``HeldGPT._apply``)."""

    def __init__(self, model: GPT) -> None:
        tr, blocks = model.transformer, list(model.transformer.h)
        self.kind = _kind(blocks[0].attn.c_attn)
        self.layers = [b.attn.layer_idx for b in blocks]
        self.per_layer = []  # ln_1 g, b, ln_2 g, b, then (weight, scale, bias) of the four linears
        for b in blocks:
            a, m = b.attn, b.mlp
            self.per_layer += [b.ln_1.weight, b.ln_1.bias, b.ln_2.weight, b.ln_2.bias]
            self.per_layer += [t for lin in (a.c_attn, a.c_proj, m.c_fc, m.c_proj) for t in _held_tensors(lin)]
        self.wte, self.wpe, self.ln_f = tr.wte.weight, tr.wpe.weight, tr.ln_f
        # read as fp32 on the CPU: the embeddings and every norm (the parameters a model's .to() casts)
        norms = [self.ln_f.weight, self.ln_f.bias, *(t for i, t in enumerate(self.per_layer) if i % 16 < 4)]
        self.fp32 = [t for t in (self.wte, self.wpe, *norms) if t is not None]
        self.eps, self.eps_f = float(blocks[0].ln_1.eps), float(self.ln_f.eps)
        head = model.lm_head  # a compiled-GEMV head (whole_step_fusable): in C at any rows, as the blocks
        self.head_kind, self.n_out, self.head_tensors = _kind(head), head.out_features, _held_tensors(head)


class HeldGPT(nn.Module):
    """A GPT held for inference (form.py's ``hold``): the network ``net`` (its linears in the chosen form),
    the dtype its attention and KV cache run in, where its weights live (``held_pages``), and, where
    ``_gemv.model_step`` computes the network (``fused``), that step for one new token a row after the
    prompt: embedding, blocks, final norm and head in one call. Every other call runs the network's own
    forward. Anything else (``config``, ``tokenizer``, ``new_kv_cache``, ...) is the network's."""

    def __init__(self, net: GPT, attn_dtype: Optional[torch.dtype] = None, held_pages=None) -> None:
        super().__init__()
        self.net, self.attn_dtype, self.held_pages = net, attn_dtype, held_pages
        self.fused = attn_dtype == torch.float32 and whole_step_fusable(net)
        self._plan: Optional[_StepPlan] = None

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") or "net" not in self.__dict__.get("_modules", {}):
                raise
            return getattr(self._modules["net"], name)

    def forward(self, idx, targets=None, kv_cache=None, last_only=False, return_logits=True, positions=None):
        if kv_cache is not None and targets is None and positions is None and self.fused:
            logits = self._decode_step(idx, kv_cache)
            if logits is not None:
                return logits, None
        with plan_free_attention(idx.device) if kv_cache is not None else contextlib.nullcontext():
            return self.net(idx, targets, kv_cache, last_only, return_logits, positions, self.attn_dtype)

    def generate(self, idx: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
        """``model/sampling.generate`` on the held model."""
        return generate(self, idx, max_new_tokens, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        self._plan = None  # a cast or a move: the tensors are looked up again
        return super()._apply(fn, *args, **kwargs)

    def _decode_step(self, idx: torch.Tensor, kv_cache) -> torch.Tensor | None:
        """The logits (B, 1, vocab) of one step through ``_gemv.model_step``, or None where it does not apply."""
        if idx.dim() != 2 or idx.shape[1] != 1 or kv_cache.pos <= 0:
            return None
        pos = None  # a KVCache: one position for all rows; the server's RowsCache: each row its own
        if type(kv_cache) is not KVCache:
            pos = kv_cache.positions(1, idx.device).reshape(-1).to(torch.int64).expand(idx.shape[0]).contiguous()
        out = self._run(idx.reshape(-1), kv_cache, pos, kv_cache.pos, None, None)
        if out is None:
            return None
        kv_cache.advance(1)
        return out.unsqueeze(1)

    def step_rows(
        self, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, wanted: torch.Tensor, kv_cache
    ):
        """One step over rows of any cache slots and positions (int64 CPU tensors, one entry a row; ``wanted``: the
        rows whose logits come back, in that order), None where the fused step does not apply. Row i puts its
        key and value at ``positions[i]`` of slot ``slots[i]`` of ``kv_cache``'s buffers and attends to that
        slot's positions up to it, the keys of the step's other rows included: several rows of one slot at
        consecutive positions are a prompt's tokens run together with the other rows' next tokens (the
        server's mixed step). The cache's buffers must hold every slot and position; nothing in the cache is
        advanced."""
        ok = all(t.dtype == torch.int64 and t.is_cpu and t.dim() == 1 for t in (ids, slots, positions, wanted))
        if not self.fused or not ok or not (len(ids) == len(slots) == len(positions) > 0) or len(wanted) == 0:
            return None
        return self._run(ids, kv_cache, positions.contiguous(), 0, slots.contiguous(), wanted.contiguous())

    def _run(self, ids, kv_cache, pos, pos0: int, slots, wanted) -> torch.Tensor | None:
        """``_gemv.model_step`` over rows ``ids`` (m,): logits (rows of ``wanted`` or all, vocab), or None."""
        plan = self._plan = self._plan or _StepPlan(self.net)
        grad = torch.is_grad_enabled()
        contiguous = plan.wte.is_contiguous() and plan.wpe.is_contiguous()
        if self.training or not contiguous or ids.dtype != torch.int64 or not ids.is_cpu:
            return None
        if any(t.dtype != torch.float32 or not t.is_cpu or (grad and t.requires_grad) for t in plan.fp32):
            return None
        m, C, nh = ids.shape[0], self.config.n_embd, self.config.n_head
        fits = m if slots is None else 1  # the rows' own slots: the kernel checks each against n_slots
        ptrs = [_ptr(t) for t in plan.per_layer]
        rows, max_len, n_slots = [], None, None
        for i, layer in enumerate(plan.layers):
            k, v = kv_cache.k[layer], kv_cache.v[layer]
            if not _kv_fits(k, v, fits, nh, C) or k.shape[2] != (max_len := max_len or k.shape[2]):  # one length
                return None
            n_slots = min(n_slots or k.shape[0], k.shape[0])  # the slots every layer holds
            rows += [*ptrs[16 * i : 16 * i + 16], k.data_ptr(), v.data_ptr()]
        ids = ids.contiguous()  # held here: the kernel reads it through its address
        out = torch.empty(m if wanted is None else len(wanted), plan.n_out, dtype=torch.float32)
        table = torch.tensor(rows, dtype=torch.int64)
        hw, hs, hb = (_ptr(t) for t in plan.head_tensors)
        done = _gemv.model_step(
            plan.kind, m, C, nh, len(plan.layers), ids.data_ptr(), plan.wte.data_ptr(), plan.wpe.data_ptr(),
            plan.wte.shape[0], plan.wpe.shape[0], table.data_ptr(), max_len, _ptr(pos), pos0, out.data_ptr(),
            plan.eps, plan.ln_f.weight.data_ptr(), _ptr(plan.ln_f.bias), plan.eps_f, plan.head_kind, hw,
            hs, hb, plan.n_out, torch.get_num_threads(), _ptr(slots), n_slots, _ptr(wanted),
            0 if wanted is None else len(wanted),
        )  # fmt: skip
        return out if done else None  # not done: a token id, position or slot outside its table


def prompt_rows(model: nn.Module) -> int:
    """How many prompt tokens ``model``'s fused step takes as rows (``step_rows``) at least as fast as its own
    forward would run them: a prompt through a panel-held or int8-gemv linear is the same compiled kernel
    either way (any count), while a row-major bf16 ``gemv`` linear multiplies a prompt past its ``tile_rows``
    (where the probe measured the matmul faster) by a matmul; 0 where the model has no fused step."""
    if not (isinstance(model, HeldGPT) and model.fused):
        return 0
    tiles = [m.tile_rows for m in tiled(model)]
    return min(tiles) if tiles else model.config.block_size
