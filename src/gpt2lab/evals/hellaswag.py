"""HellaSwag (Zellers et al. 2019): batched, distributed, compile-safe scoring of any GPT.

Scoring follows the reference recipe: each of the four candidate rows is the tokens of
``ctx`` followed by the tokens of ``" " + ending``; only the ending tokens are scored.
``acc`` picks the ending with the lowest summed cross entropy, ``acc_norm`` the lowest
mean (per ending token). Unlike the reference, many examples share one forward pass
and no work is spent on what is not scored: logits only at the positions that predict
ending tokens (``GPT.forward(positions=...)``), no row's last token, little padding.
Two ways to batch (``resolve_strategy``): 'padded' sorts the rows of all examples by
length and right-pads them (padding after a row cannot change a causal model's outputs
on it); 'shared' runs each context once into the KV cache and continues it into its
four endings.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.nn import functional as F
from tqdm import tqdm

from gpt2lab.data.tokenizer import for_model
from gpt2lab.distributed.dist import all_reduce_sum, autocast, rank, world
from gpt2lab.evals.download import DataSet, cached_file, json_lines
from gpt2lab.system.choices import HELLASWAG_STRATEGIES

# The official validation file (10,042 examples). The repository may go away; the HF
# dataset below is the second source.
HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HF_DATASET = "Rowan/hellaswag"
N_ENDINGS = 4
# A compiled model recompiles for every new input shape: round lengths up to a coarse
# multiple so the whole validation set needs only a handful of shapes.
COMPILED_PAD_MULTIPLE = 64
# Ending rows per forward in 'shared' when a batch has fewer examples: very small
# matmuls waste more than the padding saved by splitting.
SHARED_MIN_ROWS = 16
# Examples per batch. On a 2-core CPU 16, 32 and 64 measured within noise of each other
# ('shared'), 16 fastest for 'padded' (docs/benchmarks.md); a GPU may want more.
DEFAULT_BATCH_SIZE = 16


@dataclass(frozen=True)
class Example:
    ctx: str
    endings: tuple[str, ...]
    label: int


@dataclass(frozen=True)
class Score:
    """One example's result: summed and mean ending losses and both predictions."""

    sum_loss: tuple[float, ...]
    mean_loss: tuple[float, ...]
    pred: int  # argmin of sum_loss (acc)
    pred_norm: int  # argmin of mean_loss (acc_norm)
    label: int


# ---------------------------------------------------------------- data


def load_examples(path: Optional[str] = None, limit: Optional[int] = None, flag: str = "--data") -> list[Example]:
    """Examples from a jsonl file with ``ctx``, ``endings`` and ``label`` on every line.

    ``path`` None means the official validation set, downloaded once into gpt2lab's cache (evals/download.py:
    one attempt at the file's URL, the Hugging Face dataset only when that server answered without the file;
    offline or unreachable, it fails at once naming ``flag``, the caller's flag for ``path``).
    ``limit`` (at least 1; callers' flags check it) keeps the first N examples.
    """
    path = cached_file(official(), flag) if path is None else path
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"HellaSwag data {path}: no such file; pass {flag} FILE with a jsonl of ctx/endings/label lines"
        )
    examples = json_lines(path, _example, limit)
    if not examples:
        raise ValueError(f"HellaSwag data {path}: no examples in the file")
    return examples


def _example(obj: object) -> Example:
    """A line's object as an Example; a ValueError naming the field that is not one."""
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object with ctx, endings, label")
    ctx, endings, label = obj.get("ctx"), obj.get("endings"), obj.get("label")
    if not isinstance(ctx, str) or not ctx:
        raise ValueError(f"'ctx' must be a non-empty string, got {ctx!r}")
    if not (isinstance(endings, list) and len(endings) == N_ENDINGS and all(isinstance(e, str) for e in endings)):
        raise ValueError(f"'endings' must be a list of {N_ENDINGS} strings, got {endings!r}")
    if isinstance(label, str) and label.strip().isdigit():  # the HF dataset stores labels as strings
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < N_ENDINGS:
        raise ValueError(f"'label' must be an integer 0-{N_ENDINGS - 1}, got {label!r}")
    return Example(ctx=ctx, endings=tuple(endings), label=label)


def official() -> DataSet:
    """The official validation set as evals/download.py fetches it: the file's URL, then the HF dataset."""
    return DataSet(
        what="the official HellaSwag validation set",
        url=HELLASWAG_URL,
        path=os.path.join("hellaswag", "hellaswag_val.jsonl"),
        form="a jsonl with ctx, endings, label",
        check=load_examples,  # refuse to cache a file we cannot read
        second=(HF_DATASET, None, "validation", ("ctx", "endings", "label")),  # labels as strings: read as ints
    )


# ---------------------------------------------------------------- scoring


def render_example(enc, ex: Example) -> tuple[list[int], list[list[int]]]:
    """Context tokens and the tokens of ``" " + ending`` for each ending (as the reference)."""
    return enc.encode(ex.ctx), [enc.encode(" " + e) for e in ex.endings]


def _render(enc, ex: Example, block_size: int) -> tuple[list[int], list[list[int]], bool]:
    """Context and ending tokens; the context is cut from the left when a row would not
    fit in ``block_size`` (returns whether it was)."""
    ctx, ends = render_example(enc, ex)
    longest = max(len(e) for e in ends)
    if longest > block_size - 1:
        raise ValueError(
            f"HellaSwag ending of {longest} tokens cannot be scored by a model with block_size {block_size}"
        )
    keep = min(len(ctx), block_size - longest)
    return ctx[len(ctx) - keep :], ends, keep < len(ctx)


def _is_compiled(model) -> bool:
    # torch.compile's wrapper has _orig_mod (and passes other attributes through); DDP keeps what it wraps in .module
    return hasattr(model, "_orig_mod") or hasattr(getattr(model, "module", None), "_orig_mod")


def _block_size(model) -> int:
    return getattr(model, "module", model).config.block_size


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _losses(logits: torch.Tensor, targets: list[int], rows: list[int], n_rows: int, device) -> torch.Tensor:
    """Summed cross entropy per row of the scored positions (targets -1 count zero)."""
    losses = F.cross_entropy(logits.float(), torch.tensor(targets, device=device), ignore_index=-1, reduction="none")
    return torch.zeros(n_rows, device=device).index_add_(0, torch.tensor(rows, device=device), losses)


def _pack(rows: list[tuple[list[int], int, list[int], int]], n_rows: int, T: int):
    """A batch of ``n_rows`` rows of ``T`` tokens (right-padded) from (fed tokens, position of the first
    scored output, its targets, the row they count for); with the flat positions of the scored outputs,
    their targets and rows. A target -1 is not scored: no position, no logits."""
    tokens, positions, targets, row_of = torch.zeros(n_rows, T, dtype=torch.long), [], [], []
    for k, (fed, first, target, r) in enumerate(rows):
        tokens[k, : len(fed)] = torch.tensor(fed)
        scored = [(k * T + first + i, t) for i, t in enumerate(target) if t != -1]
        positions += [p for p, _ in scored]
        targets += [t for _, t in scored]
        row_of += [r] * len(scored)
    return tokens, positions, targets, row_of


@torch.no_grad()
def score_rows(model, rows: list[tuple[list[int], int, list[int]]], *, device, dtype, compiled_rows=0, kv_cache=None):
    """Summed loss of each (fed tokens, position of the first scored output, its targets) row, all rows
    in one forward pass: HellaSwag's endings and the chat eval's assistant tokens (target -1: not scored).

    Rows are right-padded (padding after a row cannot change a causal model's outputs on
    it). Logits are computed only at the positions that predict scored targets.
    ``compiled_rows`` (a compiled model) pads the batch with empty rows to that many and
    rounds the length and the number of scored positions up: few distinct shapes.
    ``kv_cache``: each row continues what the cache holds for it ('shared').
    """
    compiled = compiled_rows > 0
    T = max(len(fed) for fed, _, _ in rows)
    T = min(_round_up(T, COMPILED_PAD_MULTIPLE) if compiled else T, _block_size(model))
    R = max(compiled_rows, len(rows))
    tokens, positions, targets, row_of = _pack([(*row, r) for r, row in enumerate(rows)], R, T)
    if compiled:  # padding positions have target -1, which scores zero
        pad = _round_up(len(positions), 8 * R) - len(positions)
        positions, targets, row_of = positions + [0] * pad, targets + [-1] * pad, row_of + [0] * pad
    with autocast(device, dtype):
        logits, _ = model(tokens.to(device), kv_cache=kv_cache, positions=torch.tensor(positions, device=device))
    return _losses(logits, targets, row_of, R, device)[: len(rows)].cpu()


@torch.no_grad()
def _score_shared(model, ctxs: list[list[int]], ends: list[list[list[int]]], *, device, dtype) -> torch.Tensor:
    """Summed ending losses (n, 4) of n examples whose contexts have the same length.

    Each context runs once into the KV cache: the endings cost what they cost, the
    context a quarter of it. The 4n ending rows then continue from their example's
    cached context, sorted by length and run in passes of similar lengths (little padding).
    """
    n, flat = len(ctxs), [e for four in ends for e in four]
    ctx_cache = model.new_kv_cache(len(ctxs[0]))
    with autocast(device, dtype):
        first, _ = model(torch.tensor(ctxs, device=device), kv_cache=ctx_cache, last_only=True)
    # The last context position predicts every ending's first token.
    logits = first[:, 0].repeat_interleave(N_ENDINGS, dim=0)
    sums = _losses(logits, [e[0] for e in flat], list(range(len(flat))), len(flat), device).cpu()
    order = sorted(range(len(flat)), key=lambda r: len(flat[r]))
    per_pass = max(n, SHARED_MIN_ROWS)
    for s in range(0, len(flat), per_pass):
        rows = order[s : s + per_pass]
        T = max(len(flat[r]) for r in rows) - 1  # an ending's last token predicts nothing scored
        if T > 0:
            cache = ctx_cache.fork(torch.tensor([r // N_ENDINGS for r in rows], device=device), ctx_cache.pos + T)
            ends_rows = [(flat[r][:-1], 0, flat[r][1:]) for r in rows]
            sums[rows] += score_rows(model, ends_rows, device=device, dtype=dtype, kv_cache=cache)
    return sums.view(n, N_ENDINGS)


def resolve_strategy(strategy: str, model, device) -> str:
    """How rows share a forward pass. 'padded': rows of many examples padded into one
    batch; one graph with few shapes, so the one for compiled models. 'shared': each
    context runs once into the KV cache and continues into its four endings; about 1.7x
    fewer FLOPs on the validation set, in more and smaller forwards (batches only hold
    equal context lengths). 'auto': 'shared' for an eager model on CPU, where time is
    FLOPs, else 'padded' (a compiled model; on a GPU fewer, larger launches).

    Why this holds on any CPU, not just the one it was measured on: a CPU runs the
    forwards' matmuls at its GEMM rate once they have a few dozen rows (both strategies'
    do), so its time follows the FLOP count, and the FLOP ratio (44.1 vs 21.6 GFLOP per
    example at 124M, docs/benchmarks.md) is arithmetic on the data set, not a property of
    the machine. A GPU instead pays per launch and is idle on small forwards."""
    if strategy not in HELLASWAG_STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(HELLASWAG_STRATEGIES)}, got {strategy!r}")
    if strategy == "shared" and _is_compiled(model):
        raise ValueError("strategy 'shared' recompiles for every context length; use 'padded' with a compiled model")
    if strategy == "auto":
        return "shared" if torch.device(device).type == "cpu" and not _is_compiled(model) else "padded"
    return strategy


def _batches(rendered, strategy: str, batch_size: int) -> list[list]:
    """Batches of (example, ending) rows ('padded') or of examples ('shared').

    Longest first: the first batch shows the peak memory at once. Padded batches take
    rows of similar length from any examples (little padding); shared batches examples
    with equal context length.
    """
    if strategy == "padded":
        rows = sorted(
            ((i, j) for i in range(len(rendered)) for j in range(N_ENDINGS)),
            key=lambda ij: -(len(rendered[ij[0]][0]) + len(rendered[ij[0]][1][ij[1]])),
        )
        size = N_ENDINGS * batch_size
        return [rows[s : s + size] for s in range(0, len(rows), size)]
    by_len: dict[int, list[int]] = {}
    for i in sorted(range(len(rendered)), key=lambda i: (-len(rendered[i][0]), -max(map(len, rendered[i][1])))):
        by_len.setdefault(len(rendered[i][0]), []).append(i)
    return [group[s : s + batch_size] for group in by_len.values() for s in range(0, len(group), batch_size)]


def score_examples(
    model,
    examples: list[Example],
    *,
    device,
    dtype: str = "float32",
    batch_size: int = DEFAULT_BATCH_SIZE,
    strategy: str = "auto",
    progress: bool = False,
    stop: Callable[[], bool] = bool,
) -> list[Score]:
    """Score every example, up to ``batch_size`` examples per forward; results in input order. ``stop()``
    true before a batch (default: never) ends the scoring there: the scores after it are meaningless."""
    device = torch.device(device)
    strategy, compiled = resolve_strategy(strategy, model, device), _is_compiled(model)
    enc, block = for_model(model), _block_size(model)
    rendered = [_render(enc, ex, block) for ex in examples]
    n_cut = sum(r[2] for r in rendered)
    if n_cut:
        warnings.warn(
            f"HellaSwag: {n_cut} of {len(examples)} contexts were cut from the left to fit block_size {block}"
        )
    batches = tqdm(_batches(rendered, strategy, batch_size), desc="hellaswag", unit="batch", disable=not progress)
    sums = torch.zeros(len(examples), N_ENDINGS)
    for idx in batches:
        if stop():
            break
        if strategy == "shared":
            sums[idx] = _score_shared(
                model, [rendered[i][0] for i in idx], [rendered[i][1] for i in idx], device=device, dtype=dtype
            )
        else:
            # a row's last token is not fed (its output predicts nothing scored); its context's last
            # token's output predicts its first ending token
            rows = [((c + e)[:-1], len(c) - 1, e) for c, e in ((rendered[i][0], rendered[i][1][j]) for i, j in idx)]
            sums[tuple(zip(*idx))] = score_rows(
                model, rows, device=device, dtype=dtype, compiled_rows=N_ENDINGS * batch_size if compiled else 0
            )
    scores = []
    for ex, (_, ends, _), s in zip(examples, rendered, sums):
        m = s / torch.tensor([len(e) for e in ends])
        scores.append(Score(tuple(s.tolist()), tuple(m.tolist()), int(s.argmin()), int(m.argmin()), ex.label))
    return scores


def evaluate_hellaswag(
    model,
    data_path: Optional[str] = None,
    *,
    device,
    dtype: str = "float32",
    batch_size: int = DEFAULT_BATCH_SIZE,
    limit: Optional[int] = None,
    strategy: str = "auto",
    progress: bool = False,
    stop: Callable[[], bool] = bool,
) -> Optional[dict]:
    """HellaSwag accuracy of ``model``: {"task", "n", "acc", "acc_norm"}; None when ``stop()`` (looked at
    before each batch; default: never) said to stop on any rank.

    Under torch.distributed each rank scores examples rank, rank + world size, ... and the
    counts are summed over ranks, so every rank returns the same, whole-set result (a rank that stops
    early still meets the others at the sum).
    ``strategy`` is how rows share a forward pass (see ``resolve_strategy``).
    """
    mine = load_examples(data_path, limit)[rank() :: world()]
    kw = dict(device=device, dtype=dtype, batch_size=batch_size, strategy=strategy, stop=stop)
    scores = score_examples(model, mine, progress=progress and rank() == 0, **kw)
    counts = torch.tensor(
        [len(scores), sum(s.pred == s.label for s in scores), sum(s.pred_norm == s.label for s in scores), stop()],
        dtype=torch.long,
        device=device,
    )
    all_reduce_sum(counts)
    n, correct, correct_norm, stopped = counts.tolist()
    return None if stopped else {"task": "hellaswag", "n": n, "acc": correct / n, "acc_norm": correct_norm / n}
