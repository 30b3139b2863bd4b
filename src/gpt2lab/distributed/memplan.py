"""Per-rank memory of a training step, predicted from the architecture alone (no model is built).

``predict`` adds up what one rank holds at the peak of a step of ``gpt2lab train``: weights,
gradients, the optimizer's fp32 state (AdamW's two moments; Muon's one momentum buffer for the
blocks' matrices, NorMuon's one more value per row), DDP's gradient buckets, the low-precision
weight copies a step keeps (autocast's casts; FSDP's all-gathered blocks), the tensors autograd
saves for backward (derived from model/gpt.py and model/loss.py, see ``block_saved_bytes`` and,
for the speedrun's levers, ``lever_bytes``; for multi-token prediction, ``mtp_bytes``), the chunked
loss's workspace, and a fixed runtime overhead (on CPU also glibc's heap slack). ``plan``
searches the largest micro-batch that fits a given memory. ``gpt2lab bench memory`` prints
both next to measured peaks.

A step's memory peaks at one of three moments, and the prediction is the largest:
- ``forward``: inside the loss, after the last block; every block's saved tensors are alive,
  the gradients too when accumulating (they persist between micro-steps);
- ``recompute``: with activation checkpointing, the first block recomputed in backward;
- ``step``: the optimizer step, with every gradient and no activation.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Optional

from gpt2lab.model.config import GPTConfig
from gpt2lab.model.loss import choose_loss, chunk_rows
from gpt2lab.system.choices import STRATEGIES
from gpt2lab.system.errors import UsageError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# What a rank holds besides tensors. CUDA: the context, cuBLAS workspaces and NCCL buffers,
# none of which torch.cuda.max_memory_allocated counts (about 0.5 GiB of context on an H100
# with torch 2.x), plus room for the caching allocator's fragmentation. CPU: the resident
# size of a process that imported torch and gpt2lab's trainer (measured ~300 MB on x86-64,
# torch 2.13; the same under torchrun once gloo's process group is up).
CUDA_RUNTIME_BYTES = 2 * 2**30
CPU_PROCESS_BYTES = 300 * 2**20
FP32 = 4
# CPython before 3.11 keeps a Python call's arguments on the caller's stack until the call returns
# (3.11+ moves them into the callee's frame): what a callee rebinds is not freed there (loss_workspace_bytes)
_CALLER_KEEPS_ARGS = sys.version_info < (3, 11)


class PlanError(UsageError):
    """A value the planner cannot use (unknown strategy or dtype, non-positive size)."""


@dataclass
class Prediction:
    """Bytes one rank holds at the step's peak (``phase``), term by term."""

    phase: str
    terms: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    def to_dict(self, unit: float = 2**20) -> dict:
        """Terms and total in MiB by default (``unit`` bytes each)."""
        return {
            "phase": self.phase,
            **{k: round(v / unit, 1) for k, v in self.terms.items()},
            "total": round(self.total / unit, 1),
        }


def param_counts(cfg: GPTConfig) -> dict[str, int]:
    """Parameters by where they live: one block, all blocks, the root (wte = lm_head, wpe, ln_f).

    The modern block's switches: an untied head adds its own V*C, rotary drops wpe, RMSNorm
    has a gain and no bias (C where LayerNorm has 2C); ``bias`` false drops the four Linears' 9C
    biases a block and LayerNorm's (C each); QK-norm, ReLU^2, embed_norm, zero init and the
    softcap add no parameters. The levers: ``value_embeds`` K adds K tables of V*C to the root
    and one gate to each of the 2K blocks that read them ("blocks" counts the gates, "block" is a
    block without one); ``unet_skips`` adds n_layer // 2 weights to the root; zero_init_head none;
    ``mtp_heads`` K adds K matrices of C*C to the root (multi-token prediction's W_d; its unembedding is
    the model's own).
    """
    C = cfg.n_embd
    norm = 2 * C if cfg.norm == "layernorm" and cfg.bias else C
    matmul = 12 * C * C + (
        9 * C if cfg.bias else 0
    )  # c_attn 3C^2+3C, attn c_proj C^2+C, c_fc 4C^2+4C, mlp c_proj 4C^2+C
    block = matmul + 2 * norm
    root = cfg.vocab_size * C * (1 if cfg.tie_embeddings else 2) + norm
    root += cfg.block_size * C if cfg.pos_emb == "learned" else 0
    root += cfg.value_embeds * cfg.vocab_size * C + (cfg.n_layer // 2 if cfg.unet_skips else 0)
    root += cfg.mtp_heads * C * C
    blocks = cfg.n_layer * block + 2 * cfg.value_embeds
    return {
        "block": block,
        "blocks": blocks,
        "root": root,
        "total": blocks + root,
        "block_matmul": matmul,
    }  # what autocast casts: Linear weights and biases


def norm_saved_bytes(norm: str, C: int, device: str) -> int:
    """Bytes per token that one of the model's norms (ln_1, ln_2, ln_f) keeps for backward; its
    input is the fp32 residual stream (fp32 under autocast too).

    LayerNorm: its input and fp32 mean and rstd. RMSNorm (``F.rms_norm`` with a gain): on CPU
    torch decomposes it (aten's rms_norm_composite: pow, mean, rsqrt, two muls), which keeps
    the input, the fp32 rstd and the fp32 normalised input that the gain multiplies; on CUDA
    it runs the fused kernel (aten::_fused_rms_norm), whose backward takes the input and the
    rstd only (derivatives.yaml; from torch's source, not measured here).
    """
    if norm == "rmsnorm":
        return FP32 * C + FP32 + (FP32 * C if device == "cpu" else 0)
    return FP32 * C + 2 * FP32


def embed_norm_saved_bytes(C: int) -> int:
    """Bytes per token ``embed_norm`` keeps for backward: F.rms_norm without a gain on the fp32 embedding
    (fp32 under autocast too, which runs rms_norm in fp32) keeps its input, which nothing else keeps (the
    lookup's backward needs the ids only; the first block keeps the normalised stream), and the fp32
    rstd. CPU's decomposition and CUDA's fused kernel keep the same two without a gain."""
    return FP32 * C + FP32


def optimizer_state_bytes(cfg: GPTConfig, optimizer: str = "adamw", muon_variant: str = "muon") -> int:
    """The optimizer's state, fp32: AdamW keeps two moments per parameter; ``muon`` keeps one
    momentum buffer per matrix inside the blocks (Muon's parameters, train.optim.muon_split: the
    four Linear weights, 12 C^2 a block) and AdamW's two moments for the rest (value-embedding
    tables, gates and skip weights included); ``muon_variant`` normuon one more fp32 value per
    row of each matrix (c_attn 3C, c_fc 4C, the two c_proj C each: 9C a block). Per-parameter
    step counters (0-d tensors) are left out."""
    p = param_counts(cfg)
    if optimizer == "adamw":
        return 2 * FP32 * p["total"]
    if optimizer == "muon":
        hidden = cfg.n_layer * 12 * cfg.n_embd**2
        rows = cfg.n_layer * 9 * cfg.n_embd if muon_variant == "normuon" else 0
        return FP32 * (hidden + rows + 2 * (p["total"] - hidden))
    raise PlanError(f"optimizer {optimizer!r}: choose adamw or muon")


def feature_state_bytes(cfg: GPTConfig, n_features: int) -> int:
    """--token-features' optimizer state (train.token_features): Adam's two fp32 moments of a vector per
    feature (n_features x C) for each token table it shares (the embedding, and an untied head)."""
    return 2 * FP32 * n_features * cfg.n_embd * (1 if cfg.tie_embeddings else 2)


def block_saved_bytes(cfg: GPTConfig, micro_batch: int, seq_len: int, act: int, device: str = "cuda") -> int:
    """Bytes autograd keeps for one Block's backward over micro_batch x seq_len tokens.

    ``act`` is the element size of the matmuls' inputs and outputs (``dtype`` under autocast);
    the residual stream is fp32 either way (the embeddings are fp32 and a bf16 branch added to
    them promotes). Per token, GPT-2's block keeps: ln_1's and ln_2's inputs and statistics
    (``norm_saved_bytes``), c_attn's input (act, the norm's output cast by autocast), c_attn's
    output (3 act: q/k/v are views of it, kept by SDPA), SDPA's output (act; also c_proj's
    input: flash attention lays it out like q, here (B, T, nh, hs), so the ``.contiguous()``
    after the transpose copies nothing) and its fp32 logsumexp per head, c_fc's input (act),
    GELU's input and output (8 act; the output is c_proj's input). Dropout at p=0 keeps nothing.

    The modern block's switches (GPTConfig):
    - ``norm="rmsnorm"``: see ``norm_saved_bytes`` (CPU: one more fp32 C per norm than
      LayerNorm, less one statistic; CUDA: one statistic less).
    - ``qk_norm``: per q and k, F.rms_norm's fp32 rstd per head and its input in fp32 (under
      autocast an fp32 copy of the bf16 view; in fp32 the view of c_attn's output, already
      counted), and its output cast back to act (a new tensor SDPA keeps instead of the view;
      c_attn's output stays whole through v). On CPU the decomposition returns that output
      contiguous in (B, nh, T, hs) (CUDA's kernels are taken to do the same; not measured), so
      SDPA's output is laid out that way too and the ``.contiguous()`` before c_proj is a copy
      c_proj keeps: one more act.
    - ``pos_emb="rotary"``: the rotated q and k (act each, new tensors SDPA keeps; with qk_norm
      they replace the normalised ones, which nothing keeps then). apply_rotary's products keep
      cos and sin only (x needs no gradient from them, neg and cat keep nothing): in fp32 the
      (T, hs) tables GPT.forward builds once for every block (counted with the head in
      ``phases``), under autocast their casts to act, four per block (cos and sin for q and
      for k), which do not grow with the batch. The rotated tensors keep q's (B, T, nh, hs)
      layout (elementwise ops follow their input's strides), so no copy before c_proj.
    - ``mlp_act="relu2"``: relu keeps its output, which is also square's input (the same
      storage), and square's output is c_proj's input: 8 act, as GELU. On CUDA under autocast
      ``square`` is ``pow``, which autocast runs in fp32 there (not on CPU): pow keeps an fp32
      copy of relu's output, 4 fp32 more (from torch's autocast tables, not measured here).
    - tie_embeddings, zero_init_proj, logit_softcap: nothing in the block; ``bias`` false: the same
      tensors (a Linear keeps its input either way, LayerNorm its input and statistics); ``embed_norm``
      is before the first block (``embed_norm_saved_bytes``, counted with the head in ``phases``).

    tests/unit/test_memplan.py counts the saved tensors of a real Block on CPU for every
    combination, fp32 and bf16 autocast, exactly. What rests on torch's internals (the RMSNorm
    kernels, SDPA's and elementwise ops' output layouts, autocast's op lists) is as torch 2.13
    has it, the only version measured (not run on 2.11, the oldest gpt2lab allows). This is
    eager autograd's count; a compiled block keeps what Inductor's partitioner chooses, which for
    GPT-2's block came within 1.2% of it on an H100 (docs/benchmarks.md) but may recompute the
    modern block's elementwise extras (fp32 copies, rotated q and k) instead: not measured.
    """
    C, nh = cfg.n_embd, cfg.n_head
    low = act != FP32
    per_token = 2 * norm_saved_bytes(cfg.norm, C, device)
    per_token += C * act + 3 * C * act + C * act + nh * FP32  # c_attn in and out, SDPA out and logsumexp
    if cfg.qk_norm or cfg.pos_emb == "rotary":
        per_token += 2 * C * act  # q and k as new tensors
    if cfg.qk_norm:
        per_token += 2 * (nh * FP32 + (FP32 * C if low else 0)) + C * act
    per_token += C * act + 8 * C * act  # c_fc's input, the activation's two
    if cfg.mlp_act == "relu2" and low and device == "cuda":
        per_token += 4 * C * FP32
    tables = 4 * seq_len * (C // nh) * act if cfg.pos_emb == "rotary" and low else 0
    return micro_batch * seq_len * per_token + tables


def value_gate_saved_bytes(N: int, C: int, act: int) -> int:
    """Bytes a layer that reads a value embedding keeps for backward over N tokens on top of its
    block's (``block_saved_bytes``), for ``v = (1 - g) * v + g * ve``: the mixed v, which SDPA keeps
    (act; ``(1 - g) * v`` keeps v, a view of c_attn's output, counted already); under autocast the
    cast of the fp32 lookup to act, which ``g * ve`` keeps (in fp32 it keeps the lookup itself,
    counted by ``lever_bytes``); and ``1 - g``, one fp32 value (g is a view of the gate)."""
    return N * C * act + (N * C * act if act != FP32 else 0) + FP32


def lever_bytes(cfg: GPTConfig, N: int, act: int, recompute: bool) -> int:
    """Activation bytes the speedrun's levers add to a training forward over N tokens.

    - ``value_embeds`` K: the K fp32 lookups (N, C), alive through the forward (GPT.forward holds
      them; in fp32 they are also what the gates' products keep) and, unless the blocks are
      recomputed (activation checkpointing), each of the 2K gated layers' ``value_gate_saved_bytes``.
    - ``unet_skips``: ``w[i] * out_i`` keeps out_i, block i's output, which is block i+1's input and
      counted with it, except for the last early block when n_layer is even: its successor, the
      first late block, takes the sum as its input, so that out_i is one fp32 (N, C) more. The sums
      are their blocks' inputs, counted with them; the products are not kept.
    - ``zero_init_head``: nothing (it sets initial weights only).

    tests/unit/test_memplan.py counts what autograd keeps in a real Block with a value embedding
    and in a whole GPT with every lever on against this, fp32 and bf16 autocast, exactly.
    """
    C, K = cfg.n_embd, cfg.value_embeds
    out = K * N * C * FP32 + (0 if recompute else 2 * K * value_gate_saved_bytes(N, C, act))
    if cfg.unet_skips and cfg.n_layer % 2 == 0:
        out += N * C * FP32
    return out


def mtp_bytes(cfg: GPTConfig, N: int, act: int) -> int:
    """Activation bytes multi-token prediction (``mtp_heads`` K > 0) adds to a training forward over N
    tokens, besides its loss (``mtp_loss_bytes``): each head's W_d h keeps its input, the final hidden
    state h (N, C), fp32 and shared by the K heads in fp32, or under autocast K casts of it to act (one
    per head's matmul); and the weight's product with the loss keeps the 0-d fp32 weight. The sums
    h + W_d h and their concatenation keep nothing (the loss saves its gradients instead).
    tests/unit/test_levers.py counts what autograd keeps against this, fp32 and bf16 autocast."""
    K, C = cfg.mtp_heads, cfg.n_embd
    if not K:
        return 0
    return (N * C * FP32 if act == FP32 else K * N * C * act) + FP32


def mtp_loss_bytes(cfg: GPTConfig, N: int, act: int, chunked: bool) -> int:
    """The loss term of a training forward over N tokens with ``mtp_heads`` K: the main loss's, or, if
    larger, the multi-token loss's, which runs after it. Chunked: the main loss's saved gradients
    (grad_x (N, C) and grad_w (V, C), fp32), the heads' concatenated inputs z (K*N, C) fp32, and the
    chunked loss's workspace over K*N rows (``loss_workspace_bytes``; never the (K*N, V) logits).
    Fused (a compiled model on a GPU): the logits of the main head and of the K heads, (1 + K) N V in
    act, and z cast to act for the unembedding's backward (derived like the main head's, not measured)."""
    K, V, C = cfg.mtp_heads, cfg.vocab_size, cfg.n_embd
    if not chunked:
        return (1 + K) * N * V * act + K * N * C * act
    main = loss_workspace_bytes(N, V, C, act, FP32, FP32, cfg.logit_softcap)
    if not K:
        return main
    heads = FP32 * (N * C + V * C) + FP32 * K * N * C
    return max(main, heads + loss_workspace_bytes(K * N, V, C, act, FP32, FP32, cfg.logit_softcap))


def loss_workspace_bytes(N: int, V: int, C: int, compute: int, x_size: int, w_size: int, softcap: float = 0.0) -> int:
    """Peak bytes inside chunked_cross_entropy's forward (eager kernel), replaying its loop.

    Alive throughout: x and the weight cast to the compute dtype (when they are not in it
    already), grad_x (N, C) fp32, the kept-row mask and the clamped targets (9 bytes a row);
    per chunk, its logits and the kernel's (n, V) temporaries; the chunk gradients of a group
    until its grad_w matmul, whose result lands in the compute dtype and then in fp32. Two
    names outlive their group: ``d`` (the group's gradients, concatenated if more than one
    chunk) until the next group's first kernel returns, and ``gw`` (V, C) fp32 until the next
    group's is made (from the third group on it is no longer grad_w itself).

    The kernel without a softcap: the logits and their fp32 softmax; in low precision also the
    logits converted to fp32 first (a copy next to the softmax's output), then the softmax cast
    back. With ``softcap`` > 0 it keeps more: tanh of the fp32 logits over the cap (``t``, kept
    for the gradient through the cap), the capped logits and their softmax, all (n, V) fp32,
    and at ``p.mul_(1 - t.square_())`` a fourth for ``1 - t^2``: 16 bytes a logit in any dtype,
    against 8 (fp32) or 10 (bf16, fp16) without. The chunk's own logits are freed by then on
    CPython 3.11+, which hands a call's arguments to the callee (the kernel rebinds its only
    reference); 3.10 keeps them on the caller's stack until the call returns, so there they stay
    (``_CALLER_KEEPS_ARGS``; seen with a refcount probe, not measured with torch on 3.10).
    tests/unit/test_memplan.py measures the peak of the real loss with the profiler, with and
    without the cap, against this replay.
    """
    base = (N * C * compute if compute != x_size else 0) + (V * C * compute if compute != w_size else 0)
    base += N * C * FP32 + 9 * N

    def kernel(n: int) -> int:
        if softcap:
            return 4 * n * V * FP32 + (n * V * compute if _CALLER_KEEPS_ARGS else 0)
        # softmax(dtype=float32) of low-precision logits converts them first (a copy next to its
        # output), and its result is cast back; in fp32 there is neither copy
        return n * V * (compute + FP32) + (n * V * max(FP32, compute) if compute != FP32 else 0)

    rows, group = chunk_rows(V)
    peak, grad_w, old_gw, old_d = 0, 0, 0, 0
    for g, g0 in enumerate(range(0, N, group)):
        g1, parts = min(N, g0 + group), 0
        for s in range(g0, g1, rows):
            n = min(g1, s + rows) - s
            peak = max(peak, base + grad_w + old_gw + old_d + parts + kernel(n))
            old_d, parts = 0, parts + n * V * compute
        cat = parts if g1 - g0 > rows else 0  # torch.cat of more than one chunk is a copy
        gw = V * C * compute + (V * C * FP32 if compute != FP32 else 0)
        peak = max(peak, base + grad_w + old_gw + parts + cat + gw)
        old_d = parts  # d: the concatenation, or the one chunk's gradients
        old_gw = V * C * FP32 if g >= 1 else 0  # the first group's gw became grad_w
        grad_w = V * C * FP32
    return peak


def predict(
    cfg: GPTConfig,
    *,
    strategy: str = "ddp",
    world_size: int = 1,
    micro_batch: int = 1,
    seq_len: Optional[int] = None,
    dtype: str = "bfloat16",
    activation_checkpointing: bool = False,
    accum: int = 2,
    device: str = "cuda",
    compiled: bool = False,
    optimizer: str = "adamw",
    muon_variant: str = "muon",
    average: bool = False,
    token_features: int = 0,
) -> Prediction:
    """Peak per-rank bytes of one training step: the largest of ``phases``, plus the runtime.

    ``accum`` is the run's accumulation after any batch ramp (--batch-ramp-steps): a ramp's
    early steps accumulate fewer micro-batches of the same size, never more, so they peak no
    higher (the ramp is otherwise ignored here). ``seq_len`` is the run's after any sequence-length
    ramp (--seq-len-ramp-steps): a shorter step's micro-batch holds the same tokens in more rows, so
    every term but the rotary tables (smaller) is the same; it peaks no higher either.
    ``token_features``: --token-features' feature count (0: off); their optimizer state
    (``feature_state_bytes``) and a step's feature gradient and update are one more term."""
    check(strategy, world_size, micro_batch, dtype, accum, device)
    peak = max(
        phases(
            cfg,
            strategy=strategy,
            world_size=world_size,
            micro_batch=micro_batch,
            seq_len=seq_len,
            dtype=dtype,
            activation_checkpointing=activation_checkpointing,
            accum=accum,
            chunked_loss=choose_loss(device, compiled, sharded=strategy == "fsdp").chunked,
            device=device,
            optimizer=optimizer,
            muon_variant=muon_variant,
            average=average,
        ),
        key=lambda ph: ph.total,
    )
    peak.terms["runtime"] = runtime_bytes(device)
    if token_features:  # the moments, and a step's feature gradient and update (n_features x C each)
        step = 2 * FP32 * token_features * cfg.n_embd
        peak.terms["token_features"] = feature_state_bytes(cfg, token_features) + step
    # On CPU the peak RSS exceeds the peak of live tensors by about one more chunked-loss
    # workspace (docs/benchmarks.md): the trainer keeps freed memory in glibc's heap
    # (keep_cpu_memory), gradients made in a backward land in the hole the workspace left,
    # and the next micro-step's workspace extends the heap past them.
    if device == "cpu":
        T = seq_len or cfg.block_size
        peak.terms["allocator"] = loss_workspace_bytes(
            micro_batch * T * max(1, cfg.mtp_heads),  # multi-token prediction's is the larger
            cfg.vocab_size,
            cfg.n_embd,
            DTYPE_BYTES[dtype],
            FP32,
            FP32,
            cfg.logit_softcap,
        )
    return peak


def phases(
    cfg: GPTConfig,
    *,
    strategy: str = "ddp",
    world_size: int = 1,
    micro_batch: int = 1,
    seq_len: Optional[int] = None,
    dtype: str = "bfloat16",
    activation_checkpointing: bool = False,
    accum: int = 2,
    chunked_loss: bool = True,
    device: str = "cuda",
    optimizer: str = "adamw",
    muon_variant: str = "muon",
    average: bool = False,
) -> list[Prediction]:
    """Tensor bytes per rank at each moment a step can peak (see the module docstring).

    Activations are autocast's under both strategies (the norms in fp32, the residual stream
    fp32, matmuls in ``dtype``), for every combination of the modern block's switches. One process
    trains unwrapped whatever the strategy.
    DDP: fp32 weights, gradients and moments, DDP's buckets (one more fp32 copy of the
    gradients: ``gradient_as_bucket_view`` is off) and autocast's cached ``dtype`` copies
    of the block weights through the forward. FSDP as gpt2lab.distributed.parallel shards it: fp32
    master weights, gradients and moments split over ``world_size``; blocks gathered in
    ``dtype``, the root (wte = lm_head, wpe, ln_f) in fp32 and kept whole through forward
    and backward; one block computing and the next prefetched. Micro-steps before the last
    neither reduce nor reshard (parallel.sync_gradients), so with ``accum`` > 1 the forward
    of a later micro-step finds every block gathered and the whole gradient in fp32.
    ``accum`` > 1 keeps the gradients alive through later forwards under DDP too.
    ``chunked_loss`` False: the loss of a compiled model on a GPU (model.loss.choose_loss).
    ``device`` picks what differs between CPU and CUDA kernels in what autograd keeps
    (``block_saved_bytes``: RMSNorm, ReLU^2 under autocast). The speedrun's levers: ``lever_bytes``;
    FSDP's two blocks in flight are counted without the value-embedding gates (one value each);
    multi-token prediction: ``mtp_bytes`` and ``mtp_loss_bytes``, and under autocast the heads' K
    cached casts of W_d (K C^2 act, with the weight copies), which its backward keeps.
    ``average``: --ema-decay's fp32 copy of the weights (never sharded: refused with FSDP).
    """
    check(strategy, world_size, micro_batch, dtype, accum, device)
    T = seq_len or cfg.block_size
    N, V, C, L = micro_batch * T, cfg.vocab_size, cfg.n_embd, cfg.n_layer
    p, a = param_counts(cfg), DTYPE_BYTES[dtype]
    whole = FP32 * p["total"]
    fsdp = strategy == "fsdp" and world_size > 1
    shard = world_size if fsdp else 1
    fixed = {
        "weights": whole // shard,
        "optimizer": optimizer_state_bytes(cfg, optimizer, muon_variant) // shard,
        "comm_buffers": whole if strategy == "ddp" and world_size > 1 else 0,
    }
    if average:
        fixed["average"] = whole
    if fsdp:
        in_flight = FP32 * p["root"] + 2 * a * p["block"]
        gathered = FP32 * p["root"] + a * p["blocks"]
        copies, one_copy = (gathered, gathered) if accum > 1 else (in_flight, in_flight)
        grads_fwd, grads_bwd = (whole, whole) if accum > 1 else (0, whole // shard)
    else:  # autocast caches its casts of the block weights until the forward ends
        cast = a * p["block_matmul"] if a != FP32 else 0
        copies, one_copy = L * cast, cast
        grads_fwd, grads_bwd = (whole if accum > 1 else 0), whole
    heads = a * cfg.mtp_heads * C * C if a != FP32 else 0  # multi-token prediction: W_d's casts, kept
    copies, one_copy = copies + heads, one_copy + heads
    block = block_saved_bytes(cfg, micro_batch, T, a, device)
    kept = L * FP32 * N * C if activation_checkpointing else L * block
    kept += lever_bytes(cfg, N, a, activation_checkpointing) + mtp_bytes(cfg, N, a)
    # ln_f's saved tensors and its output, the token ids (inputs and targets, int64); rotary: the fp32
    # cos and sin tables (T, head size) GPT.forward builds once and passes to every block
    head = N * norm_saved_bytes(cfg.norm, C, device) + FP32 * N * C + 16 * N
    head += 2 * T * (C // cfg.n_head) * FP32 if cfg.pos_emb == "rotary" else 0
    head += N * embed_norm_saved_bytes(C) if cfg.embed_norm else 0
    # the chunked loss's workspace, or the logits (N, V) in ``dtype`` that a compiled graph's fused
    # cross-entropy keeps (H100, 124M, B=64: 28.48 GiB measured, 28.36 predicted this way)
    loss = mtp_loss_bytes(cfg, N, a, chunked_loss)  # with mtp_heads 0: the main loss's alone
    out = [
        Prediction(
            "forward", {**fixed, "grads": grads_fwd, "weight_copies": copies, "activations": kept + head, "loss": loss}
        )
    ]
    if activation_checkpointing:  # the last block recomputed next to the loss's saved gradients
        saved_loss = FP32 * (N * C + V * C) + (FP32 * (cfg.mtp_heads * N * C + V * C) if cfg.mtp_heads else 0)
        block += value_gate_saved_bytes(N, C, a) if cfg.value_embeds else 0  # the last block reads one
        out.append(
            Prediction(
                "recompute",
                {
                    **fixed,
                    "grads": grads_bwd,
                    "weight_copies": one_copy,
                    "activations": kept + block + saved_loss,
                    "loss": 0,
                },
            )
        )
    out.append(Prediction("step", {**fixed, "grads": whole // shard, "weight_copies": 0, "activations": 0, "loss": 0}))
    return out


def runtime_bytes(device: str) -> int:
    if device == "cuda":
        return CUDA_RUNTIME_BYTES
    return CPU_PROCESS_BYTES


def fits(predicted_bytes: int, device_bytes: int) -> bool:
    """Whether a predicted peak fits a device: the one rule of the planner and of --strategy auto.

    No further margin: the prediction's runtime term already holds the CUDA context and
    room for the allocator's fragmentation, and it ran 0-5% above the measured peaks.
    """
    return predicted_bytes <= device_bytes


def largest_micro_batches(
    gpu_bytes: int,
    cfg: GPTConfig,
    *,
    world_size: int = 1,
    seq_len: Optional[int] = None,
    dtype: str = "bfloat16",
    max_batch: int = 4096,
    compiled: bool = True,
) -> list[dict]:
    """The largest micro-batch whose predicted peak fits ``gpu_bytes``, per strategy and
    activation checkpointing: [{"strategy", "activation_checkpointing", "micro_batch",
    "predicted_bytes"}]; micro_batch 0 where not even one sequence fits."""
    if gpu_bytes <= 0:
        raise PlanError(f"memory to plan for must be positive, got {gpu_bytes} bytes")
    rows = []
    for strategy in STRATEGIES:
        for ac in (False, True):

            def fits_at(B: int) -> bool:
                return fits(
                    predict(
                        cfg,
                        strategy=strategy,
                        world_size=world_size,
                        micro_batch=B,
                        seq_len=seq_len,
                        dtype=dtype,
                        activation_checkpointing=ac,
                        compiled=compiled,
                    ).total,
                    gpu_bytes,
                )

            best = _largest(fits_at, max_batch)
            total = predict(
                cfg,
                strategy=strategy,
                world_size=world_size,
                micro_batch=max(best, 1),
                seq_len=seq_len,
                dtype=dtype,
                activation_checkpointing=ac,
                compiled=compiled,
            ).total
            rows.append(
                {"strategy": strategy, "activation_checkpointing": ac, "micro_batch": best, "predicted_bytes": total}
            )
    return rows


def _largest(fits, cap: int) -> int:
    """Largest B in [1, cap] with fits(B) (fits is monotone), 0 if none: doubling, then bisection."""
    if not fits(1):
        return 0
    good = 1
    while good < cap and fits(min(2 * good, cap)):
        good = min(2 * good, cap)
    bad = min(2 * good, cap + 1)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def check(strategy: str, world_size: int, micro_batch: int, dtype: str, accum: int, device: str) -> None:
    """Raise PlanError naming the first value the planner cannot use."""
    if strategy not in STRATEGIES:
        raise PlanError(f"strategy {strategy!r} unknown; use one of {', '.join(STRATEGIES)}")
    if dtype not in DTYPE_BYTES:
        raise PlanError(f"dtype {dtype!r} unknown; use one of {', '.join(DTYPE_BYTES)}")
    if device not in ("cuda", "cpu"):
        raise PlanError(f"device {device!r}: the planner knows cuda and cpu")
    for name, v in (("world size", world_size), ("micro-batch", micro_batch), ("accumulation steps", accum)):
        if v < 1:
            raise PlanError(f"{name} must be at least 1, got {v}")


def choose(
    gpu_bytes: int, cfg: GPTConfig, *, world_size: int, seq_len: int, total_batch_tokens: int, dtype: str = "bfloat16"
) -> dict:
    """What a size preset assumes for a card: {"strategy", "activation_checkpointing", "micro_batch"}.

    The micro-batch is a power of two (so it divides a power-of-two batch at any power-of-two
    world size) no larger than the plan's nor than one step's share per rank. The strategy
    is the one with the larger such micro-batch, DDP on a tie (it moves no weights between
    ranks); activation checkpointing only where neither fits a sequence without it.
    """
    cap = max(1, total_batch_tokens // (seq_len * world_size))
    best = None
    for row in largest_micro_batches(
        gpu_bytes, cfg, world_size=world_size, seq_len=seq_len, dtype=dtype, max_batch=cap
    ):
        B = 1 << (row["micro_batch"].bit_length() - 1) if row["micro_batch"] else 0
        key = (not row["activation_checkpointing"] and B > 0, B, row["strategy"] == "ddp")
        if best is None or key > best[0]:
            best = (
                key,
                {
                    "strategy": row["strategy"],
                    "activation_checkpointing": row["activation_checkpointing"],
                    "micro_batch": B,
                },
            )
    return best[1]
