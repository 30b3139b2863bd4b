"""HellaSwag (Zellers et al. 2019): batched, distributed, compile-safe scoring of any GPT.

Scoring follows the reference recipe: each of the four candidate rows is the tokens of
``ctx`` followed by the tokens of ``" " + ending``; only the ending tokens are scored.
``acc`` picks the ending with the lowest summed cross entropy, ``acc_norm`` the lowest
mean (per ending token). Unlike the reference, many examples share one forward pass:
rows are sorted by length, right-padded (padding after the ending cannot change a causal
model's logits on the real tokens) and masked out of the loss.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import urllib.request
import warnings
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.nn import functional as F

from gpt2lab.dist import all_reduce_sum, autocast

# The official validation file (10,042 examples). The repository may go away; the HF
# dataset below is the second source.
HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HF_DATASET = "Rowan/hellaswag"
CACHE_ENV = "GPT2LAB_CACHE"
N_ENDINGS = 4
# A compiled model recompiles for every new input shape: round lengths up to a coarse
# multiple so the whole validation set needs only a handful of shapes.
COMPILED_PAD_MULTIPLE = 64
EAGER_PAD_MULTIPLE = 8


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

def cache_dir() -> str:
    """Where downloads are kept: $GPT2LAB_CACHE, else ~/.cache/gpt2lab."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "gpt2lab")


def load_examples(path: Optional[str] = None, limit: Optional[int] = None) -> list[Example]:
    """Examples from a jsonl file with ``ctx``, ``endings`` and ``label`` on every line.

    ``path`` None means the official validation set, downloaded once into ``cache_dir()``.
    ``limit`` keeps the first N examples.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of examples, got {limit}")
    if path is None:
        path = official_validation_file()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"HellaSwag data {path}: no such file; pass --data FILE with a jsonl "
                                "of ctx/endings/label lines")
    examples = []
    for lineno, line in _lines(path):
        examples.append(_parse_line(line, path, lineno))
        if limit is not None and len(examples) >= limit:
            break
    if not examples:
        raise ValueError(f"HellaSwag data {path}: no examples in the file")
    return examples


def _lines(path: str) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():  # blank lines (a trailing newline) hold no example
                yield lineno, line


def _parse_line(line: str, path: str, lineno: int) -> Example:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg}); each line must be one JSON object") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with ctx, endings, label")
    ctx, endings, label = obj.get("ctx"), obj.get("endings"), obj.get("label")
    if not isinstance(ctx, str) or not ctx:
        raise ValueError(f"{where}: 'ctx' must be a non-empty string, got {ctx!r}")
    if not (isinstance(endings, list) and len(endings) == N_ENDINGS and all(isinstance(e, str) for e in endings)):
        raise ValueError(f"{where}: 'endings' must be a list of {N_ENDINGS} strings, got {endings!r}")
    if isinstance(label, str) and label.strip().isdigit():  # the HF dataset stores labels as strings
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < N_ENDINGS:
        raise ValueError(f"{where}: 'label' must be an integer 0-{N_ENDINGS - 1}, got {label!r}")
    return Example(ctx=ctx, endings=tuple(endings), label=label)


def official_validation_file() -> str:
    """Path of the cached official validation jsonl, downloading it on first use."""
    dest = os.path.join(cache_dir(), "hellaswag", "hellaswag_val.jsonl")
    if os.path.isfile(dest):
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    errors = []
    for fetch in (_download_url, _download_hf):
        try:
            _atomic_write(dest, fetch)
            return dest
        except Exception as e:  # any failure: try the next source, report all at the end
            errors.append(f"{fetch.__name__}: {e}")
    raise RuntimeError(
        "could not fetch the HellaSwag validation set (" + "; ".join(errors) + "). "
        f"With no network, pass --data FILE (a jsonl with ctx, endings, label) or place the "
        f"official hellaswag_val.jsonl at {dest}"
    )


def _atomic_write(dest: str, fetch) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest), prefix=".tmp-")
    os.close(fd)
    try:
        fetch(tmp)
        load_examples(tmp)  # refuse to cache a file we cannot read
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _download_url(dest: str) -> None:
    with urllib.request.urlopen(HELLASWAG_URL, timeout=60) as r, open(dest, "wb") as f:
        shutil.copyfileobj(r, f)


def _download_hf(dest: str) -> None:
    from datasets import load_dataset  # optional dependency, only for this fallback

    ds = load_dataset(HF_DATASET, split="validation")
    with open(dest, "w", encoding="utf-8") as f:
        for row in ds:
            f.write(json.dumps({"ctx": row["ctx"], "endings": row["endings"], "label": int(row["label"])}) + "\n")


# ---------------------------------------------------------------- scoring

def render_example(enc, ex: Example) -> tuple[list[int], list[list[int]]]:
    """Context tokens and the tokens of ``" " + ending`` for each ending (as the reference)."""
    return enc.encode(ex.ctx), [enc.encode(" " + e) for e in ex.endings]


def _rows(enc, ex: Example, block_size: int) -> tuple[list[list[int]], list[int], bool]:
    """The four token rows and their ending lengths; the context is cut from the left
    when a row would not fit in ``block_size`` (returns whether it was)."""
    ctx, ends = render_example(enc, ex)
    longest = max(len(e) for e in ends)
    if longest > block_size - 1:
        raise ValueError(f"HellaSwag ending of {longest} tokens cannot be scored by a model with "
                         f"block_size {block_size}")
    keep = min(len(ctx), block_size - longest)
    return [ctx[len(ctx) - keep:] + e for e in ends], [len(e) for e in ends], keep < len(ctx)


def _is_compiled(model) -> bool:
    # torch.compile's wrapper has _orig_mod; DDP keeps what it wraps in .module
    return hasattr(model, "_orig_mod") or hasattr(getattr(model, "module", None), "_orig_mod")


def _block_size(model) -> int:
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    return getattr(config, "block_size", None) or getattr(config, "n_positions", 1024)


@torch.no_grad()
def _score_batch(model, rows: list[list[int]], end_lens: list[int], *, device, dtype, pad_multiple: int,
                 n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed and mean ending loss of each row, from one forward pass."""
    T = max(len(r) for r in rows)
    T = -(-T // pad_multiple) * pad_multiple
    T = min(T, _block_size(model))
    R = max(n_rows, len(rows))  # dummy rows keep the batch shape fixed for a compiled model
    tokens = torch.zeros(R, T, dtype=torch.long)
    mask = torch.zeros(R, T, dtype=torch.bool)  # True where a token is part of an ending
    for i, (row, n_end) in enumerate(zip(rows, end_lens)):
        tokens[i, :len(row)] = torch.tensor(row)
        mask[i, len(row) - n_end:len(row)] = True
    tokens, mask = tokens.to(device), mask.to(device)
    with autocast(device, dtype):
        logits, _ = model(tokens)
    # Position t predicts token t+1; take only positions whose target is an ending token.
    target_mask = mask[:, 1:]
    picked = logits[:, :-1][target_mask].float()  # (n_ending_tokens, V)
    losses = F.cross_entropy(picked, tokens[:, 1:][target_mask], reduction="none")
    row_of = torch.arange(R, device=device)[:, None].expand(R, T - 1)[target_mask]
    sums = torch.zeros(R, device=device).index_add_(0, row_of, losses)
    counts = target_mask.sum(1).clamp(min=1)
    return sums[:len(rows)].cpu(), (sums / counts)[:len(rows)].cpu()


@torch.no_grad()
def _score_shared(model, ctxs: list[list[int]], ends: list[list[list[int]]], *, device, dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed and mean ending losses for examples whose contexts have the same length.

    The context runs once per example into the KV cache, which is then copied to the
    four ending rows: the endings cost what they cost, the context a quarter of it.
    """
    n, Lc = len(ctxs), len(ctxs[0])
    flat = [e for four in ends for e in four]
    Le = max(len(e) for e in flat)
    cache = model.new_kv_cache(Lc + Le)
    with autocast(device, dtype):
        ctx_logits, _ = model(torch.tensor(ctxs, device=device), kv_cache=cache)
        for layer in range(len(cache.k)):
            cache.k[layer] = cache.k[layer].repeat_interleave(N_ENDINGS, dim=0)
            cache.v[layer] = cache.v[layer].repeat_interleave(N_ENDINGS, dim=0)
        tokens = torch.zeros(N_ENDINGS * n, Le, dtype=torch.long)
        for i, e in enumerate(flat):
            tokens[i, :len(e)] = torch.tensor(e)
        tokens = tokens.to(device)
        end_logits, _ = model(tokens, kv_cache=cache)
    # The first ending token is predicted by the last context position, the rest by the
    # ending positions before them: (4n, Le, V) with padding after each ending.
    logits = torch.cat([ctx_logits[:, -1:].repeat_interleave(N_ENDINGS, dim=0), end_logits[:, :-1]], dim=1)
    lens = torch.tensor([len(e) for e in flat], device=device)
    mask = torch.arange(Le, device=device)[None, :] < lens[:, None]
    losses = F.cross_entropy(logits[mask].float(), tokens[mask], reduction="none")
    row_of = torch.arange(len(flat), device=device)[:, None].expand(len(flat), Le)[mask]
    sums = torch.zeros(len(flat), device=device).index_add_(0, row_of, losses)
    return sums.cpu(), (sums / lens).cpu()


def _batches_padded(rendered, order, batch_size):
    for start in range(0, len(order), batch_size):
        yield order[start:start + batch_size]


def _batches_shared(rendered, order, batch_size):
    """Groups of up to batch_size examples with equal context length (kept after any cut)."""
    by_len: dict[int, list[int]] = {}
    for i in order:
        by_len.setdefault(len(rendered[i][0][0]) - rendered[i][1][0], []).append(i)
    for group in by_len.values():
        for start in range(0, len(group), batch_size):
            yield group[start:start + batch_size]


STRATEGIES = ("padded", "shared")


def _check_strategy(strategy: str) -> None:
    """'padded': rows of many examples padded into one batch (one graph, few shapes: the
    one for compiled models). 'shared': each context runs once into the KV cache and is
    copied to its four endings; batches only hold equal context lengths (eager models)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")


def score_examples(model, examples: list[Example], *, device, dtype: str = "float32", batch_size: int = 16,
                   strategy: str = "padded", progress: bool = False) -> list[Score]:
    """Score every example, up to ``batch_size`` examples per forward; results in input order."""
    from gpt2lab.tokenizer import get_tokenizer

    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    device = torch.device(device)
    _check_strategy(strategy)
    if strategy == "shared" and _is_compiled(model):
        raise ValueError("strategy 'shared' recompiles for every context length; use 'padded' with a compiled model")
    compiled = _is_compiled(model)
    enc, block = get_tokenizer(), _block_size(model)
    rendered = [_rows(enc, ex, block) for ex in examples]
    n_cut = sum(r[2] for r in rendered)
    if n_cut:
        warnings.warn(f"HellaSwag: {n_cut} of {len(examples)} contexts were cut from the left to fit "
                      f"block_size {block}")
    # Longest first: batches hold rows of similar length (little padding) and the first
    # batch shows the peak memory at once.
    order = sorted(range(len(examples)), key=lambda i: -max(len(r) for r in rendered[i][0]))
    batches = list((_batches_shared if strategy == "shared" else _batches_padded)(rendered, order, batch_size))
    if progress:
        from tqdm import tqdm

        batches = tqdm(batches, desc="hellaswag", unit="batch")
    scores: list[Optional[Score]] = [None] * len(examples)
    for idx in batches:
        if strategy == "shared":
            ctxs = [rendered[i][0][0][:len(rendered[i][0][0]) - rendered[i][1][0]] for i in idx]
            ends = [[row[len(ctxs[j]):] for row in rendered[i][0]] for j, i in enumerate(idx)]
            sums, means = _score_shared(model, ctxs, ends, device=device, dtype=dtype)
        else:
            rows = [row for i in idx for row in rendered[i][0]]
            end_lens = [n for i in idx for n in rendered[i][1]]
            sums, means = _score_batch(model, rows, end_lens, device=device, dtype=dtype,
                                       pad_multiple=COMPILED_PAD_MULTIPLE if compiled else EAGER_PAD_MULTIPLE,
                                       n_rows=N_ENDINGS * batch_size if compiled else 0)
        for j, i in enumerate(idx):
            s, m = sums[N_ENDINGS * j:N_ENDINGS * (j + 1)], means[N_ENDINGS * j:N_ENDINGS * (j + 1)]
            scores[i] = Score(tuple(s.tolist()), tuple(m.tolist()), int(s.argmin()), int(m.argmin()),
                              examples[i].label)
    return scores


def evaluate_hellaswag(model, data_path: Optional[str] = None, *, device, dtype: str = "float32",
                       batch_size: int = 16, limit: Optional[int] = None, rank: int = 0, world_size: int = 1,
                       strategy: str = "padded", progress: bool = False) -> dict:
    """HellaSwag accuracy of ``model``: {"task", "n", "acc", "acc_norm"}.

    Under torch.distributed each rank scores examples rank, rank + world_size, ... and the
    counts are summed over ranks, so every rank returns the same, whole-set result.
    ``strategy`` is how rows share a forward pass (see ``_check_strategy``).
    """
    if world_size > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"world_size {world_size} needs an initialised torch.distributed process group")
    examples = load_examples(data_path, limit)
    mine = examples[rank::world_size]
    scores = score_examples(model, mine, device=device, dtype=dtype, batch_size=batch_size, strategy=strategy,
                            progress=progress and rank == 0)
    counts = torch.tensor([len(scores), sum(s.pred == s.label for s in scores),
                           sum(s.pred_norm == s.label for s in scores)], dtype=torch.long, device=device)
    if world_size > 1:
        all_reduce_sum(counts)
    n, correct, correct_norm = counts.tolist()
    return {"task": "hellaswag", "n": n, "acc": correct / n, "acc_norm": correct_norm / n}
