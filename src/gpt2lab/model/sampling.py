"""Sampling from the network: temperature, top-k, top-p, greedy, stop on a token, streaming.

The loop needs only what any GPT has (``config``, ``new_kv_cache``, a forward taking ``kv_cache``
and ``last_only``), so it lives beside the model and imports nothing of it. ``generate`` runs the
model it is given, as it is: it times nothing, prints nothing and writes nothing. For the speed of
``gpt2lab sample``, give it the inference form of the model (``gpt2lab.for_inference``).

With the KV cache the prompt is run once and each new token costs one position of
compute; without it (or once the sequence outgrows the block) the last ``block_size``
tokens are re-run every step, which is what the cache must reproduce token for token.

The defaults (temperature 1, top-k 50, top-p 1) are ``SAMPLING`` (model/sampling_defaults.py), the same
for ``gpt2lab sample``, the server and ``generate``; ``top_k`` 0 or None keeps every token, ``top_p`` 1 or
None all the mass.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
from torch.nn import functional as F

from gpt2lab.model.sampling_defaults import SAMPLING

# Below this temperature logits / T can overflow float32; sample_next shifts the logits first.
SMALL_TEMPERATURE = 1e-20


def sample_next(
    logits: torch.Tensor,
    temperature: float = SAMPLING.temperature,
    top_k: Optional[int] = SAMPLING.top_k,
    top_p: Optional[float] = SAMPLING.top_p,
    generator: Union[torch.Generator, Sequence[torch.Generator], None] = None,
    narrowed: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Pick one token per row from logits (B, V); temperature 0 is greedy (argmax). ``narrowed``: these
    logits' ``torch.topk`` at ``top_k`` where the caller has it already (``top_k_rows``). ``generator``: one
    for all rows, or one per row (a server's rows, each its request's: row i then draws what it draws alone,
    every step of the draw being row by row)."""
    if not temperature >= 0:  # NaN too
        raise ValueError(f"temperature must be a number >= 0, got {temperature}")
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    if temperature < SMALL_TEMPERATURE:
        # logits / T would overflow to inf (and 1e-320 is 0 in float32: 0/0); shifted by the row's
        # maximum the best token scales to 0 and the rest to -inf or below, which softmax takes:
        # all the mass on the most likely token(s), as T -> 0, ties still drawn at random.
        top = logits.amax(dim=-1, keepdim=True)
        logits = (logits - top) / max(temperature, torch.finfo(torch.float32).tiny)
    ids = None  # (B, k): the token of each column of ``logits`` once only some tokens can be drawn
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 keeps every token), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k:  # sorted, most likely first
        logits, ids = narrowed if narrowed is not None else torch.topk(logits, min(top_k, logits.size(-1)), dim=-1)
    if temperature >= SMALL_TEMPERATURE and temperature != 1:
        # after top-k: dividing by T > 0 keeps the order (ties aside), so the same tokens are kept and
        # only k logits are divided, not the vocabulary (a pass over 50,257 floats a token, ~0.15 ms on
        # a 2-core EPYC just after a decode step has streamed the weights through the caches)
        logits = logits / temperature
    if top_p is not None and top_p < 1:  # 1 keeps all (a cumulative sum can reach 1.0 early in float32)
        if ids is None:
            logits, ids = torch.sort(logits, descending=True, dim=-1)
        probs = F.softmax(logits, dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass;
        # the most likely token is always kept.
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        drop[:, 0] = False  # a top_p below float32's smallest (1e-320 is 0 there) keeps it too
        logits = logits.masked_fill(drop, float("-inf"))
    # One uniform number per row through the cumulative distribution (inverse transform sampling):
    # torch.multinomial draws an exponential per token, 50,257 of them a row (~0.8 ms on a 2-core Zen 5).
    cdf = F.softmax(logits, dim=-1).cumsum(dim=-1)
    if isinstance(generator, (list, tuple)):
        u = torch.cat([torch.rand(1, 1, generator=g, device=cdf.device) for g in generator])
    else:
        u = torch.rand(cdf.size(0), 1, generator=generator, device=cdf.device)
    u = u * cdf[:, -1:]
    pick = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.size(-1) - 1)  # never a zero-probability token
    return (pick if ids is None else ids.gather(-1, pick)).squeeze(-1)


def top_k_rows(logits: torch.Tensor, settings: list[tuple[float, Optional[int]]]) -> list:
    """For a batch whose rows draw with settings of their own ((temperature, top_k) each), each row's
    ``narrowed`` for ``sample_next``: one ``torch.topk`` for all the rows of a k (a server's rows mostly
    share one). On a CPU a row's values and tokens are those it gets alone (topk works row by row); a GPU
    may order tied logits otherwise in a batch, where a batch's logits already differ from a row's alone.
    None for a row that narrows otherwise: greedy, no top-k, or a temperature so small that its logits
    are shifted first."""
    logits = logits.float()
    out: list = [None] * len(settings)
    by_k: dict[int, list[int]] = {}
    for i, (temperature, k) in enumerate(settings):
        if k and k > 0 and temperature >= SMALL_TEMPERATURE:
            by_k.setdefault(min(k, logits.size(-1)), []).append(i)
    for k, rows in by_k.items():
        values, ids = torch.topk(logits if len(rows) == logits.size(0) else logits[rows], k, dim=-1)
        for j, i in enumerate(rows):
            out[i] = (values[j : j + 1], ids[j : j + 1])
    return out


@contextlib.contextmanager
def plan_free_attention(device: torch.device) -> Iterator[None]:
    """Around a step with a KV cache (model/sampling.py's loop, a held model's cached calls). A KV cache gives
    the attention new key lengths (and strides) every call. cuDNN's attention, SDPA's first choice for bf16
    on Hopper GPUs, builds a plan for each new shape: ~4 ms of host time a layer against ~3 us of GPU work
    (an H200, torch 2.11: a 124M decode step 43-56 ms where its shapes were new, 4-6 ms where seen;
    docs/benchmarks.md). Such steps take SDPA's other kernels; training's one shape keeps cuDNN. The flag
    is the process's: set for the block only."""
    off = torch.backends.cuda.cudnn_sdp_enabled() and not torch.compiler.is_compiling()  # (on any device: a flag)
    if off:
        torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        if off:
            torch.backends.cuda.enable_cudnn_sdp(True)


@torch.inference_mode()
def generate_stream(
    model: torch.nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = SAMPLING.temperature,
    top_k: Optional[int] = SAMPLING.top_k,
    top_p: Optional[float] = SAMPLING.top_p,
    generator: Optional[torch.Generator] = None,
    stop_token: Optional[int] = None,
    use_cache: bool = True,
    on_logits: Optional[Callable[[torch.Tensor], None]] = None,
    then: Callable[[torch.Tensor], Sequence[int]] = lambda tokens: (),
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (tokens (B,), finished (B,) bool) once per new position.

    A row that produced ``stop_token`` is finished: later positions repeat ``stop_token``
    for it. The stream ends early when every row is finished. ``on_logits``, if given, sees
    each step's logits (B, real vocabulary) before the tokens are drawn from them. ``then`` sees
    each step's drawn tokens (B,) and returns token ids to follow them in every row as if drawn (a
    tool's output; by default none): yielded one position each, counted in ``max_new_tokens``, and
    run through the model with the next step.
    """
    if idx.dim() != 2 or idx.size(1) == 0:
        raise ValueError(f"idx must be (batch, time) with at least one token, got shape {tuple(idx.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    V = model.config.vocab_size
    if idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < V):
        bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
        raise ValueError(f"token id {bad} is outside the model's vocabulary (0 to {V - 1})")
    B, T = idx.shape
    block = model.config.block_size
    finished = torch.zeros(B, dtype=torch.bool, device=idx.device)
    # The cache only ever holds what fits in the block; size it to this generation, not more.
    cache = model.new_kv_cache(min(block, T + max_new_tokens)) if use_cache else None
    seq = torch.empty(B, T + max_new_tokens, dtype=idx.dtype, device=idx.device)  # filled as we go
    seq[:, :T] = idx
    n = T
    while n < T + max_new_tokens:
        if cache is not None and n <= cache.max_len:
            # The whole prompt on the first step, then only the tokens since (the one drawn last, and then's).
            with plan_free_attention(idx.device):
                logits, _ = model(seq[:, cache.pos : n], kv_cache=cache, last_only=True)
        else:
            # Past the block the window slides, every position moves, and the cache no longer applies.
            logits, _ = model(seq[:, max(0, n - block) : n], last_only=True)
        logits = logits[:, -1, : model.config.real_vocab_size]  # padded vocabulary rows are never sampled
        if on_logits is not None:
            on_logits(logits)
        drawn = sample_next(logits, temperature, top_k, top_p, generator)
        for nxt in [drawn, *(torch.full_like(drawn, t) for t in then(drawn))][: T + max_new_tokens - n]:
            if stop_token is not None:
                nxt = torch.where(finished, torch.full_like(nxt, stop_token), nxt)
                finished = finished | (nxt == stop_token)
            seq[:, n] = nxt
            n += 1
            yield nxt, finished
            if stop_token is not None and bool(finished.all()):
                return


@torch.no_grad()
def generate(model: torch.nn.Module, idx: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """idx (B, T) followed by the generated tokens: (B, T + n), n <= max_new_tokens; keyword
    arguments as ``generate_stream`` (by default ``SAMPLING``'s: temperature 1, top-k 50, top-p 1, as
    ``gpt2lab sample``). The model runs as given (see the module's docstring)."""
    new = [tok[:, None] for tok, _ in generate_stream(model, idx, max_new_tokens, **kwargs)]
    return torch.cat([idx, *new], dim=1)
