"""GPT-2, exactly: config, attention, MLP, block, model, and a KV cache for generation.

Parameter names follow Hugging Face's GPT-2 (``transformer.h.0.attn.c_attn.weight``) so
that moving weights between the two is four transposes and nothing else (see weights/gpt2.py).
No I/O, printing, optimizer or distributed code lives here.

Beside GPT-2, the modern block's switches (GPTConfig.pos_emb, norm, qk_norm, mlp_act,
tie_embeddings, bias, embed_norm, zero_init_proj, logit_softcap) and the speedrun's levers (value_embeds,
unet_skips, zero_init_head; mtp_heads, a training loss only), each a small branch below; off, the model is
GPT-2's to the bit.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

# Defined torch-free (the CLI's flags come from its fields); this is its home for every caller.
from gpt2lab.model.config import PRESET_ALIASES, PRESETS, GPTConfig  # noqa: F401
from gpt2lab.model.loss import LossPath, chunked_cross_entropy


def rotary_cos_sin(config: GPTConfig, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of positions ``pos`` in fp32: (T, head_size) for pos (T,), or (B, 1, T,
    head_size) for pos (B, T) (a cache whose rows sit at different positions).

    Pair i of a head is the channels (i, i + head_size/2), turned by position * theta^(-2i/hs)
    radians (the "rotate half" layout of GPT-NeoX and Llama).
    """
    hs = config.n_embd // config.n_head
    inv_freq = config.rope_theta ** -(torch.arange(0, hs, 2, device=pos.device, dtype=torch.float32) / hs)
    angles = pos.to(torch.float32)[..., None] * inv_freq  # (..., T, hs/2)
    angles = torch.cat((angles, angles), dim=-1)
    if angles.dim() == 3:  # (B, T, hs) -> (B, 1, T, hs): one row of positions for every head
        angles = angles[:, None]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, nh, T, hs) rotated pairwise: (a, b) -> (a cos - b sin, b cos + a sin)."""
    a, b = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-b, a), dim=-1) * sin.to(x.dtype)


def norm_layer(config: GPTConfig) -> nn.Module:
    """GPT-2's LayerNorm (without its bias when config.bias is false), or RMSNorm (a gain, no bias, no mean)."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=config.layer_norm_epsilon)
    return nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)


def value_embed_table(config: GPTConfig, layer: int) -> Optional[int]:
    """The value-embedding table layer ``layer`` mixes into its values (None: none). With K
    tables, table i feeds layer i and its U-net partner, layer n_layer - K + i."""
    K, L = config.value_embeds, config.n_layer
    if layer < K:
        return layer
    return layer - (L - K) if layer >= L - K else None


class ReLUSquared(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x).square()


class KVCache:
    """Keys and values of every layer for one batch being generated.

    Buffers are allocated on the first write, with the dtype the attention produced (so
    autocast gives a bf16 cache), and sized for ``max_len`` positions. ``pos`` counts the
    positions filled; the model advances it after each forward. The model asks the cache
    for the new tokens' positions and attention mask (``positions``, ``mask``), so a cache
    whose rows hold different lengths (serve/batch.py) can stand in for this one.
    """

    def __init__(self, n_layer: int, max_len: int) -> None:
        self.n_layer, self.max_len, self.pos = n_layer, max_len, 0  # pos: the positions filled
        self.k: list[Optional[torch.Tensor]] = [None] * n_layer
        self.v: list[Optional[torch.Tensor]] = [None] * n_layer

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nh, T, hs) at positions pos..pos+T; return all keys/values so far."""
        B, nh, T, hs = k.shape
        end = self.pos + T
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {end} requested")
        if self.k[layer] is None:
            self.k[layer] = k.new_empty(B, nh, self.max_len, hs)
            self.v[layer] = v.new_empty(B, nh, self.max_len, hs)
        self.k[layer][:, :, self.pos : end] = k
        self.v[layer][:, :, self.pos : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def positions(self, T: int, device: torch.device) -> torch.Tensor:
        """Positions of the next T tokens: (T,), the same for every row."""
        return torch.arange(self.pos, self.pos + T, dtype=torch.long, device=device)

    def mask(self, T: int, device: torch.device) -> Optional[torch.Tensor]:
        """Which keys each of the next T queries may see (None: all of them); query i sees up to pos + i."""
        if T == 1:
            return None
        rows = torch.arange(T, device=device)[:, None] + self.pos
        return torch.arange(self.pos + T, device=device)[None, :] <= rows

    def advance(self, T: int) -> None:
        self.pos += T

    def fork(self, rows: torch.Tensor, max_len: int) -> "KVCache":
        """A cache whose row i continues row ``rows[i]`` of this one, with room for ``max_len``
        positions (one prefix run once, continued several ways: HellaSwag's four endings)."""
        new = KVCache(self.n_layer, max_len)
        new.pos = self.pos
        for old, buf in ((self.k, new.k), (self.v, new.v)):
            for layer, past in enumerate(old):
                past = past[rows]  # (len(rows), nh, pos, hs)
                buf[layer] = past.new_empty(past.shape[0], past.shape[1], max_len, past.shape[3])
                buf[layer][:, :, : self.pos] = past
        return new


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Attention of new queries to the cached keys. One bf16/fp16 query on a CPU takes SDPA's math
    kernel (the same arithmetic): PyTorch's CPU flash kernel runs a single reduced-precision query
    slower than eight (283 vs 147 us at 512 keys on a Zen 5; math 124 us; docs/benchmarks.md)."""
    if q.size(2) == 1 and q.device.type == "cpu" and q.dtype != torch.float32:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.qk_norm = config.qk_norm
        self.eps = config.layer_norm_epsilon
        self.attn_pdrop = config.attn_pdrop
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.RESIDUAL_SCALE_INIT = True
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        if value_embed_table(config, layer_idx) is not None:  # 1-D: FSDP2 shards no 0-d parameter
            self.ve_gate = nn.Parameter(torch.full((1,), 0.5))

    def forward(
        self,
        x: torch.Tensor,
        kv_cache: Optional[KVCache] = None,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        ve: Optional[torch.Tensor] = None,
        attn_dtype: Optional[torch.dtype] = None,  # q, k, v (and the KV cache) cast to this; None: as computed
    ) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.c_attn(x)
        q, k, v = (qkv if attn_dtype is None else qkv.to(attn_dtype)).split(C, dim=2)
        if ve is not None:  # value embedding: v = (1 - g) v + g ve (g 0-d: v keeps its dtype under autocast)
            g = self.ve_gate[0]
            v = (1 - g) * v + g * ve.to(v.dtype)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if self.qk_norm:  # no gain; cast back, autocast may run the norm in fp32
            q, k = (F.rms_norm(t, (t.size(-1),), eps=self.eps).to(v.dtype) for t in (q, k))
        if rope is not None:  # rotary: positions enter here (the cache keeps keys already turned)
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if kv_cache is None or kv_cache.pos == 0:
            # Training, or the prompt of a generation: keys are exactly the queries' positions.
            if kv_cache is not None:
                kv_cache.update(self.layer_idx, k, v)
            # SDPA applies dropout whenever dropout_p > 0, so it must be 0 outside training.
            p = self.attn_pdrop if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        else:
            mask = kv_cache.mask(T, x.device)  # before update: it reads the positions filled so far
            k, v = kv_cache.update(self.layer_idx, k, v)  # (B, nh, past+T, hs)
            y = cached_attention(q, k, v, mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        # GPT-2 was trained with the tanh approximation of GELU; exact GELU would drift
        # from OpenAI's weights.
        self.act = nn.GELU(approximate="tanh") if config.mlp_act == "gelu" else ReLUSquared()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.RESIDUAL_SCALE_INIT = True
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = norm_layer(config)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = norm_layer(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, *attn_args) -> torch.Tensor:  # attn_args: kv_cache, rope, ve, attn_dtype
        # Pre-LayerNorm: the residual stream itself is never normalised, only each branch's input.
        x = x + self.attn(self.ln_1(x), *attn_args)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The network. ``tokenizer``: the tokenizer its ids belong to where it is not GPT-2's (a trained one,
    as its loader read it from beside the weights; data.tokenizer.for_config gives a model's tokenizer);
    the model itself never reads it."""

    def __init__(self, config: GPTConfig, tokenizer: Optional[object] = None) -> None:
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(config.vocab_size, config.n_embd)))
        if config.pos_emb == "learned":  # rotary has no table: q and k are turned in attention
            self.transformer["wpe"] = nn.Embedding(config.block_size, config.n_embd)  # (second: optimizer order)
        self.transformer["drop"] = nn.Dropout(config.embd_pdrop)
        self.transformer["h"] = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.transformer["ln_f"] = norm_layer(config)
        if config.value_embeds:  # value_embed_table says which layers read each one
            self.transformer["ve"] = nn.ModuleList(
                nn.Embedding(config.vocab_size, config.n_embd) for _ in range(config.value_embeds)
            )
        if config.unet_skips:  # entry i: the weight of block i's output in the input of block n_layer-1-i
            self.skip_weights = nn.Parameter(torch.ones(config.n_layer // 2))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            # Weight tying (Press & Wolf 2017), as GPT-2: input and output embeddings share one matrix.
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        if config.zero_init_head:
            nn.init.zeros_(self.lm_head.weight)
        if config.mtp_heads:  # W_d of each extra head, zero: every head starts as the next-token head
            self.mtp = nn.ModuleList(
                nn.Linear(config.n_embd, config.n_embd, bias=False) for _ in range(config.mtp_heads)
            )
            for head in self.mtp:
                nn.init.zeros_(head.weight)
            # the auxiliary loss's weight, set by the trainer each step (set_mtp_weight); a buffer filled in
            # place, so a compiled model sees no new constant; not saved (the step decides it)
            self.register_buffer("mtp_weight", torch.tensor(float(config.mtp_weight)), persistent=False)
        self.set_loss(LossPath())  # the chunked loss, its kernel eager, until a caller chooses (set_loss)
        # Activation checkpointing (--activation-checkpointing): in training, keep only each
        # block's input and recompute its insides during backward (about a third more compute
        # for a fraction of the activation memory). The trainer sets it; no weights change.
        self.activation_checkpointing = False

    @classmethod
    def from_pretrained(cls, source: str, device: Optional[torch.device | str] = None) -> "GPT":
        """``GPT.from_pretrained("gpt2")``: ``gpt2lab.from_pretrained``, the one loader (weights/load.py:
        a hub name, an HF directory, a run or checkpoint directory), imported here only when called, so
        the model stays a leaf (tests/unit/test_layering.py names this one exemption)."""
        from gpt2lab.weights.load import from_pretrained

        return from_pretrained(source, device)

    def set_loss(self, path: LossPath) -> "GPT":
        """How the training loss (``return_logits=False``) is computed: ``path.chunked``, model.loss's
        chunked cross-entropy, never holding the (B*T, vocab) logits, its kernel compiled if
        ``path.compiled``; else logits + F.cross_entropy, which torch.compile fuses into the model's
        graph. model.loss.choose_loss decides it for a run. Returns the model."""
        self._chunked_loss, self._compile_loss = bool(path.chunked), bool(path.compiled)
        return self

    def set_mtp_weight(self, weight: float) -> None:
        """The weight of the multi-token prediction loss in the training loss (mtp_heads > 0)."""
        self.mtp_weight.fill_(weight)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "RESIDUAL_SCALE_INIT", False):
                # Each block adds two branches to the residual stream; scaling their output projections by
                # 1/sqrt(2 * n_layer) keeps its variance from growing with depth. zero_init_proj: 0, so each
                # block starts as the identity (the first step's gradient reaches c_proj only).
                std = 0.0 if self.config.zero_init_proj else std * (2 * self.config.n_layer) ** -0.5
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters counted once (tied wte and lm_head are one tensor); ``non_embedding``
        leaves out the tables only looked up, never multiplied: wpe, the value embeddings, and
        wte when untied."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel() if "wpe" in self.transformer else 0
            n -= 0 if self.config.tie_embeddings else self.transformer.wte.weight.numel()
            n -= sum(p.numel() for p in self.transformer.ve.parameters()) if "ve" in self.transformer else 0
        return n

    def _blocks(
        self, x: torch.Tensor, idx: torch.Tensor, kv_cache: Optional[KVCache], rope, attn_dtype=None
    ) -> torch.Tensor:
        """The residual stream ``x`` through every block (value embeddings, U-net skips, checkpointing)."""
        recompute = self.activation_checkpointing and self.training and kv_cache is None
        ves = [table(idx) for table in self.transformer.ve] if "ve" in self.transformer else []
        skips = []  # unet_skips: the outputs of the first n_layer // 2 blocks
        for i, block in enumerate(self.transformer.h):
            mirror = self.config.n_layer - 1 - i
            if mirror < len(skips):  # a late block: its input gets its early mirror's output, weighted
                x = x + self.skip_weights[mirror] * skips[mirror]
            t = value_embed_table(self.config, i)
            ve = None if t is None else ves[t]
            # non-reentrant checkpointing replays the block's dropout masks (it saves the RNG state)
            args = (x, kv_cache, rope, ve, attn_dtype)
            x = checkpoint(block, *args, use_reentrant=False) if recompute else block(*args)
            if self.config.unet_skips and i < self.config.n_layer // 2:
                skips.append(x)
        return x

    def forward(
        self,
        idx: torch.Tensor,
        targets: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
        last_only: bool = False,
        return_logits: bool = True,
        positions: Optional[torch.Tensor] = None,
        attn_dtype: Optional[torch.dtype] = None,
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """idx (B, T) token ids -> logits (B, T, vocab_size) and, with targets, the mean loss.

        Targets equal to -1 are ignored. With ``kv_cache`` the tokens continue the cached
        sequence (positions start at ``kv_cache.pos``) and the cache advances by T.
        ``last_only`` returns logits (B, 1, vocab_size) for the last position only.
        ``positions`` (N,) indexes the flattened B*T positions (row b, position t is
        b*T + t) and returns logits (N, vocab_size) there only, the loss too if targets
        (B, T) are given: scoring that reads a few positions per row skips the rest of the
        vocab matmul, at GPT-2 124M about a third of the forward's FLOPs per position.
        ``return_logits=False`` with targets (the training path) returns ``(None, loss)`` and
        computes the loss chunk by chunk without ever holding the (B*T, vocab) logits.
        ``attn_dtype``: q, k, v (and the KV cache) cast to it (a held model's, inference/fused.py).
        """
        B, T = idx.shape
        if last_only and positions is not None:
            raise ValueError("pass last_only or positions, not both")
        start = kv_cache.pos if kv_cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(f"sequence length {start + T} exceeds block_size {self.config.block_size}")
        # (T,), or (B, T) for a cache whose rows hold different lengths
        pos = kv_cache.positions(T, idx.device) if kv_cache is not None else torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx)  # (B, T, C)
        rope = rotary_cos_sin(self.config, pos) if self.config.pos_emb == "rotary" else None
        if rope is None:
            x = x + self.transformer.wpe(pos)
        if self.config.embed_norm:  # the stream starts at unit RMS (no gain), as NanoChat's
            x = F.rms_norm(x, (x.size(-1),), eps=self.config.layer_norm_epsilon)
        x = self.transformer.drop(x)
        x = self._blocks(x, idx, kv_cache, rope, attn_dtype)
        if kv_cache is not None:
            kv_cache.advance(T)
        if last_only:  # generation needs the next token only: skip T-1 rows of the vocab matmul
            x = x[:, -1:, :]
        elif positions is not None:
            x = x.reshape(B * T, -1)[positions]  # (N, C)
            targets = None if targets is None else targets.reshape(-1)[positions]
        x = self.transformer.ln_f(x)
        # the training path (targets, return_logits=False) takes the chunked loss where set: no (B*T, vocab) logits
        chunked = targets is not None and not return_logits and self._chunked_loss
        logits = None if chunked else self._logits(x)  # (B, T, vocab_size), or (N, vocab_size) at positions
        loss = None if targets is None else self._loss(x, targets, logits)
        # multi-token prediction: in training, on whole sequences (never in evaluation or generation). Head d
        # (1..K) reads z = x + W_d x at position t and is scored against token t+1+d, which is targets[:, t+d]
        # (positions whose target lies past the row, and targets of -1, are left out); the mean over every
        # kept (head, position) pair, through the shared unembedding and softcap.
        if self.config.mtp_heads and self.training and targets is not None and positions is None and not last_only:
            z = torch.cat([x + head(x) for head in self.mtp])  # (K*B, T, C): head d's rows are block d-1
            ignored = targets.new_full((B, self.config.mtp_heads), -1)
            shifted = torch.cat(
                [torch.cat((targets[:, d:], ignored[:, :d]), 1)[:, :T] for d in range(1, len(self.mtp) + 1)]
            )
            loss = loss + self.mtp_weight * self._loss(z, shifted, None if chunked else self._logits(z))
        return (logits if return_logits or targets is None else None), loss

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """lm_head's logits of the hidden states x; with logit_softcap, capped smoothly at +-cap in fp32."""
        logits, cap = self.lm_head(x), self.config.logit_softcap
        return cap * torch.tanh(logits.float() / cap) if cap else logits

    def _loss(self, x: torch.Tensor, targets: torch.Tensor, logits: Optional[torch.Tensor]) -> torch.Tensor:
        """The mean cross entropy over the targets that are not -1 (0 when none is: a turn with no assistant
        token): of ``logits``, or, without them, model.loss's chunked loss of the hidden states x."""
        if logits is None:
            W, cap = self.lm_head.weight, self.config.logit_softcap
            return chunked_cross_entropy(x.reshape(-1, x.size(-1)), W, targets.reshape(-1), self._compile_loss, cap)
        flat = logits.reshape(-1, logits.size(-1)).float()
        kept = (targets != -1).sum().clamp(min=1)
        return F.cross_entropy(flat, targets.reshape(-1), ignore_index=-1, reduction="sum") / kept

    def new_kv_cache(self, max_len: Optional[int] = None) -> KVCache:
        return KVCache(self.config.n_layer, max_len or self.config.block_size)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6N + 12 * n_layer * n_embd * T (PaLM appendix B; N
        without position embeddings). The second term is attention's QK^T and AV. Multi-token
        prediction's heads multiply by the shared unembedding once more each: 6 * mtp_heads * V * C
        (their W_d are in N)."""
        c = self.config
        mtp = 6 * c.mtp_heads * c.vocab_size * c.n_embd
        return 6 * self.num_params(non_embedding=True) + 12 * c.n_layer * c.n_embd * seq_len + mtp

    def generate(self, idx: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
        """nanoGPT's habit: ``model.sampling.generate(self, idx, max_new_tokens, **kwargs)``, the model as it is."""
        from gpt2lab.model.sampling import generate

        return generate(self, idx, max_new_tokens, **kwargs)
