"""Measuring the inference candidates on this machine, for the CLI: the device's facts, then each
candidate timed on the model itself, cached per machine and model shape (system/runtime.py's cache),
announced on stderr before it runs. ``decide`` hands the figures to inference/choice.py's ``choose``.

What is timed: every candidate's reference figures (a ``REQUEST_TOKENS``-token prefill and a one-row
decode step) and, where several dtypes run, a ``BATCH_ROWS``-row step of each dtype's best kernel, from
which the dtype is chosen, the same for every workload; for ``serve``, then, the ``--max-batch``-row step
of the chosen dtype's kernels. A loaded machine must not decide for good:

* each figure is the best of ``REPEATS`` calls after an untimed one; when the second best is over
  ``UNSTEADY`` times the best, ``REPEATS`` more are timed, and a figure whose two best calls of all
  still disagree that much is neither kept nor used (below);
* the best candidate of each dtype, whose figures decide the dtype, is timed a second time after all the
  others, and the best of both passes kept: a load that slowed one candidate's every call has passed by then;
* figures not kept are not used either: the device's rule decides this run (the batch figures alone:
  the kernel by the one-row figures), so that processes on a busy machine still agree on a choice; why
  they were not kept is noted in the cache, for ``gpt2lab env`` (the console has one line: the choice);
* a run that sees its choice run far slower than its figure (``Watch``) removes the entry, so the next
  run measures again.

Only commands call this (``sample``, ``serve``, ``eval``, ``bench``): the library's ``for_inference``
reads the cache at most. ``GPT2LAB_PROBE=0`` skips the measuring (the device's rule decides);
``GPT2LAB_PROBE=fresh`` measures again.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Optional

import torch

from gpt2lab.inference.choice import (
    BATCH_ROWS,
    REQUEST_TOKENS,
    Candidate,
    Decision,
    InferenceRequest,
    Timing,
    as_json,
    candidates,
    cheapest_dtype,
    choose,
    crossover,
    device_pick,
    reference_cost,
    tile_rows_of,
)
from gpt2lab.inference.form import cache_key, cached_timings, detect_facts, hold
from gpt2lab.inference.kernels import set_tile_rows, tiled
from gpt2lab.model.gpt import GPT
from gpt2lab.system import env, runtime

CONTEXT = 32  # tokens already cached when decode steps are timed
STEPS = 4  # decode steps per timed call
REPEATS = 3  # timed calls per figure (the best is kept), after one untimed
# A candidate whose untimed first call of a figure is this many times the best candidate's figure
# so far is dropped untimed: it cannot win (a cost sums the figures, each at least this far behind
# except one), and a kernel 20-50x off (int8 with fp32 activations on a Zen 5) would take most of
# the probe's time.
GIVE_UP = 10.0
# Back-to-back calls of one computation on one machine differ by clock ramps and caches, a few
# percent, on any machine: a call twice as slow as the best of the same work had the cores or the
# device taken from it for half its time. A ratio of the same work, so it holds whatever the speed.
UNSTEADY = 2.0
# A run's own one-row steps (the same held weights, one row, at most REQUEST_TOKENS positions, so at
# most a few tens of percent more attention than the probe's) against its choice's figure: 3x is
# no noise of the same work; the figure was taken on another machine state.
DISAGREE = 3.0
WATCH_STEPS = 8  # the run's steps whose median is compared (after its prefill)
# The shorter of the two prompts the ``gemv`` kernel's prefill is timed at both ways (matmul, tiles), the
# longer being REQUEST_TOKENS (choice.crossover): short enough that the tiles' lead, where a machine gives
# them one, shows (the widening pass they save is most of a short prefill), long enough to be timed well.
SHORT_TOKENS = 16


class _TooSlow(Exception):
    """A candidate given up untimed: its first call was over GIVE_UP times the best candidate's figure."""


def _best_ms(fn, device: torch.device, per_call=1, limit: Optional[float] = None, what="", doubts=None) -> float:
    """The best of REPEATS timed calls of ``fn`` in ms (per ``per_call``), timed once more when unsteady
    (an unsteady figure is added to ``doubts``); _TooSlow, naming the figure ``what``, when the untimed
    first is over GIVE_UP times ``limit``."""
    timed = lambda: runtime.timed(fn, device, time.perf_counter)[0]  # noqa: E731
    first = 1e3 * timed() / per_call
    if limit is not None and first > GIVE_UP * limit:
        raise _TooSlow(
            f"{what} {first:.3g} ms against the best candidate's {limit:.3g} ms (over {GIVE_UP:g}x): "
            "slower, not timed further"
        )
    times = sorted(timed() for _ in range(REPEATS))
    if times[1] > UNSTEADY * times[0]:  # two calls disagree: a second round, the best of all kept
        times = sorted(times + [timed() for _ in range(REPEATS)])
        if times[1] > UNSTEADY * times[0] and doubts is not None:
            doubts.append(f"{what} unsteady ({times[1] / times[0]:.1f}x between its best calls)")
    return 1e3 * times[0] / per_call


FIGURES = ("prefill", "step1")  # the reference figures
ROWS_FIGURES = ("step_rows", "step_batch")  # serve's --max-batch-row step; each dtype's best's BATCH_ROWS-row step


@torch.inference_mode()
def measure(
    model: GPT, cand: Candidate, request: InferenceRequest, device, best=None, figures=FIGURES, doubts=None, tile_rows=1
) -> Timing:
    """``figures`` of ``model`` held as ``cand`` (for ``request.rows`` rows when the ``step_rows`` figure
    is asked, else one; ``gemv``: its tiles up to ``tile_rows`` rows): a real prefill, real decode steps
    (given the ``best`` figures so far, a candidate far behind is given up: _TooSlow); ``tile_rows`` asked
    of a ``gemv`` candidate held with tiles (kernels.tiled; not a panel hold, whose kernel takes every
    row count): where its tiles stop paying (_tiles), the prefill then the faster way's. What should not be
    kept goes to ``doubts``."""
    best = best or Timing()
    rows = request.rows if "step_rows" in figures else BATCH_ROWS if "step_batch" in figures else 1
    prepared = hold(model, cand, rows, tile_rows=tile_rows)
    block, vocab = model.config.block_size, model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    out: dict = {}
    if "prefill" in figures:
        prompt = min(REQUEST_TOKENS, block)
        ids = torch.randint(0, vocab, (1, prompt), generator=gen).to(device)
        run = lambda: prepared(ids, kv_cache=prepared.new_kv_cache(prompt), last_only=True)  # noqa: E731
        out["prefill"] = _best_ms(run, device, 1, best.prefill, f"{cand.name} prefill", doubts)
        if "tile_rows" in figures and cand.kernel == "gemv" and tiled(prepared):
            out.update(_tiles(prepared, out["prefill"], device, gen))
    context = min(CONTEXT, max(1, block // 4))
    steps = max(1, min(STEPS, (block - context) // (2 * REPEATS + 1)))

    def decode_ms(rows: int, limit: Optional[float]) -> float:
        cache = prepared.new_kv_cache(min(block, context + steps * (2 * REPEATS + 1)))
        prepared(torch.randint(0, vocab, (rows, context), generator=gen).to(device), kv_cache=cache)
        tok = torch.randint(0, vocab, (rows, 1), generator=gen).to(device)

        def run() -> None:
            for _ in range(steps):
                prepared(tok, kv_cache=cache, last_only=True)

        what = f"{cand.name} " + ("step" if rows == 1 else f"{rows}-row step")
        return _best_ms(run, device, steps, limit, what, doubts)

    for figure, n in zip(("step1", *ROWS_FIGURES), (1, request.rows, BATCH_ROWS)):
        if figure in figures:
            out[figure] = decode_ms(n, getattr(best, figure))
    return Timing(**out)


def _tiles(prepared: GPT, matmul_long: float, device: torch.device, gen: torch.Generator) -> dict:
    """A ``gemv`` hold's prefill timed at SHORT_TOKENS both ways and at REQUEST_TOKENS by its tiles (by its
    matmul there, upcast's or bf16's as held: ``matmul_long``): ``tile_rows`` (choice.crossover) and the
    prefill of REQUEST_TOKENS the faster way, as the hold then runs it. Not checked for steadiness: a
    figure off by a busy moment moves where the tiles stop, which is a speed (the same products, summed
    in another order; past the tiles a bf16 matmul rounds a prompt's inputs to bf16, as bf16 does)."""
    block, vocab = prepared.config.block_size, prepared.config.vocab_size
    lengths = (min(SHORT_TOKENS, block), min(REQUEST_TOKENS, block))
    if lengths[0] >= lengths[1]:
        return {}
    ids = torch.randint(0, vocab, (1, lengths[1]), generator=gen).to(device)

    def prefill_ms(n: int, rows: int) -> float:
        set_tile_rows(prepared, rows)
        return _best_ms(lambda: prepared(ids[:, :n], kv_cache=prepared.new_kv_cache(n), last_only=True), device)

    try:
        short = (prefill_ms(lengths[0], 1), prefill_ms(lengths[0], lengths[0]))
        tiles_long = prefill_ms(lengths[1], lengths[1])
    finally:
        set_tile_rows(prepared, 1)
    rows = crossover(short, (matmul_long, tiles_long), lengths)
    return {"tile_rows": rows, "prefill": tiles_long if rows >= lengths[1] else matmul_long}


def _bar(done: dict) -> Timing:
    """The best of each figure measured so far (the bar a hopeless candidate is given up at)."""
    ts = [dataclasses.asdict(t) for t in done.values() if isinstance(t, Timing)]
    return Timing(**{f: min((t[f] for t in ts if t[f] is not None), default=None) for f in FIGURES + ROWS_FIGURES})


def _measure_each(model, cands, request, device, figures, doubts, held: Optional[dict] = None) -> dict:
    """``figures`` of each of ``cands``, each held with the ``tile_rows`` of its figures in ``held``."""
    out: dict = {}
    for c in cands:
        tiles = tile_rows_of((held or {}).get(c.name))
        try:
            out[c.name] = measure(model, c, request, device, _bar(out), figures, doubts, tiles)
        except _TooSlow as e:
            out[c.name] = f"given up: {e}"
        except (RuntimeError, NotImplementedError) as e:  # a kernel this build cannot run with these weights
            out[c.name] = f"failed: {str(e).splitlines()[0][:160]}"
    return out


def reference_timings(model: GPT, cands: list[Candidate], device: torch.device, doubts: list) -> dict:
    """Every candidate's reference figures, the best candidate of each dtype timed twice and at BATCH_ROWS rows
    (module docstring); what should not be kept goes to ``doubts``."""
    one = InferenceRequest(rows=1)
    out = _measure_each(model, cands, one, device, FIGURES + ("tile_rows",), doubts)
    timed = [c for c in cands if isinstance(out[c.name], Timing)]
    dtypes = dict.fromkeys(c.dtype for c in timed)
    per_dtype = {d: min((c for c in timed if c.dtype == d), key=lambda c: reference_cost(out[c.name])) for d in dtypes}
    for c in per_dtype.values() if len(per_dtype) > 1 else ():  # the dtype is decided between these
        then, tiles = out[c.name], tile_rows_of(out[c.name])
        again = measure(model, c, one, device, figures=FIGURES, doubts=doubts, tile_rows=tiles)  # after the others
        batch = measure(model, c, one, device, figures=("step_batch",), doubts=doubts, tile_rows=tiles)
        best = {f: min(getattr(then, f), getattr(again, f)) for f in FIGURES}
        out[c.name] = dataclasses.replace(then, step_batch=batch.step_batch, **best)
    return out


@torch.inference_mode()
def estimate_seconds(model: GPT, n_candidates: int, request: InferenceRequest, device, n_rows=0) -> float:
    """About how long the measuring takes: one prefill and one decode step of ``model`` as it is, timed
    here, times the calls ``measure`` makes for ``n_candidates`` (and their second pass, at most one per
    candidate) and, for ``serve``, the ``n_rows`` candidates' batch steps (a rough figure for the notice)."""
    block, vocab = model.config.block_size, model.config.vocab_size
    prompt = max(1, min(REQUEST_TOKENS, block - 1))  # and room for one decode step after it
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    model(ids[:, :1], last_only=True)  # untimed: the first touch of freshly loaded (mapped) weights
    cache = model.new_kv_cache(min(block, prompt + 1))
    prefill, _ = runtime.timed(lambda: model(ids, kv_cache=cache, last_only=True), device, time.perf_counter)
    step, _ = runtime.timed(lambda: model(ids[:, :1], kv_cache=cache, last_only=True), device, time.perf_counter)
    per = (1 + REPEATS) * (prefill + STEPS * step) + prefill * CONTEXT / prompt
    rows = (1 + REPEATS) * STEPS * (step + prefill * request.rows / prompt) + prefill * CONTEXT / prompt
    return n_candidates * per + (n_rows * rows if request.workload == "serve" else 0.0)


def _notice(command: str, what: str, model: GPT, request: InferenceRequest, device, n_timed: int, n_rows: int) -> None:
    """The one stderr line before measuring: what, about how long (``estimate_seconds``), and that it is done
    once."""
    secs = estimate_seconds(model, n_timed, request, device, n_rows)
    about = f"about {secs:.0f} s" if secs >= 1 else "under a second"
    _say(
        f"{command}: measuring {what} on this machine, {about}, once per machine and model shape "
        "(GPT2LAB_PROBE=0 skips it; gpt2lab env lists the figures)"
    )


def _say(line: str) -> None:
    """One line on stderr, at once."""
    print(line, file=sys.stderr, flush=True)


NOT_KEPT = "measured on a busy machine, not kept (gpt2lab env says why), the device's rule"


def decide(
    model: GPT, device, request: InferenceRequest, facts: Optional[runtime.Facts] = None, command="gpt2lab"
) -> Decision:
    """Measure (where there is a choice, and the cache has no figures; a first measurement says so on
    stderr, ``command`` first) and choose."""
    facts = facts or detect_facts(device)
    cands = candidates(request, facts)
    mode = env.probe_mode()
    if len(cands) == 1 or mode == "0":
        return choose(request, facts)
    first = device_pick(cands, facts)  # the likeliest winner first: it sets the bar to give up at
    cands = [first] + [c for c in cands if c != first]
    names = [c.name for c in cands]
    key = cache_key(model.config, device, names)
    entry = None if mode == "fresh" else runtime.cached().get(key)
    timings = cached_timings(entry)
    if timings is None or set(timings) != set(names):
        dtypes = {c.dtype for c in cands}
        n_rows = max(sum(c.dtype == d for c in cands) for d in dtypes) if request.workload == "serve" else 0
        n_tiles = sum(c.kernel == "gemv" for c in cands)  # its prefill timed three more ways: about a candidate
        n_timed = len(cands) + n_tiles + (len(dtypes) if len(dtypes) > 1 else 0)
        _notice(command, f"{len(cands)} ways to run this model", model, request, device, n_timed, n_rows)
        doubts: list = []
        timings = reference_timings(model, cands, device, doubts)
        _write(key, model, device, None, None if doubts else timings, doubts or None)
        if doubts:  # neither kept nor used: the device's rule decides, the same in every process
            decision = choose(request, facts)
            return dataclasses.replace(decision, reason=decision.reason.replace("not measured", NOT_KEPT, 1))
        entry = {}
    kept = request.workload != "serve" or _serve_rows(
        model, device, request, facts, cands, key, entry, timings, command
    )
    decision = choose(request, dataclasses.replace(facts, timings=timings))
    found = runtime.cached().get(key) if kept else None
    label = f"serve {request.rows} rows" if request.workload == "serve" else request.workload
    if found is not None and (found.get("choices") or {}).get(label) != decision.candidate.name:
        # what the workload chose, where that changed (for gpt2lab env)
        runtime.cache_update(key, lambda e: e.setdefault("choices", {}).__setitem__(label, decision.candidate.name))
    return decision


def _serve_rows(model, device, request, facts, cands, key: str, entry: Optional[dict], timings: dict, command) -> bool:
    """``serve``: the ``--max-batch``-row step of the chosen dtype's kernels, from the cache ``entry`` or measured,
    added to ``timings`` (in place); False where figures just measured were not kept (nor used: the kernel by
    the one-row figures, as any process takes it)."""
    dtype, _ = cheapest_dtype(cands, dataclasses.replace(facts, timings=timings))
    pool = [c for c in cands if c.dtype == dtype and isinstance(timings.get(c.name), Timing)]
    rows = cached_timings(entry, request.rows)  # None when measured afresh
    kept = True
    if len(pool) > 1 and (rows is None or not set(c.name for c in pool) <= set(rows)):
        what = f"the {request.rows}-row step of {len(pool)} ways to serve this model"
        _notice(command, what, model, request, device, 0, len(pool))
        doubts: list = []
        out = _measure_each(model, pool, request, device, ("step_rows",), doubts, timings)
        kept = not doubts  # figures not kept are not used either
        rows = {k: (t.step_rows if isinstance(t, Timing) else t) for k, t in out.items()} if kept else None
        _write(key, model, device, request.rows, rows, doubts or None)
    for name, r in (rows or {}).items():
        if isinstance(timings.get(name), Timing):
            timings[name] = dataclasses.replace(timings[name], step_rows=r) if isinstance(r, float) else r
    return kept


class Watch:
    """A run's own one-row steps against the cached figure of its choice: a median of WATCH_STEPS steps
    over DISAGREE times that figure removes the cache entry (said once on stderr), so the next run
    measures again. Fed by inference/completion.stream_tokens."""

    def __init__(self, key: str, name: str, step_ms: float, command: str) -> None:
        self.key, self.name, self.step_ms, self.command = key, name, step_ms, command
        self.seen: list[float] = []
        self.done = False

    def see(self, position: int, ms: float) -> None:
        """One decode step of ``ms`` whose new token is at ``position`` (0-based) of its sequence."""
        if self.done or position > REQUEST_TOKENS:
            return
        self.seen.append(ms)
        if len(self.seen) < WATCH_STEPS:
            return
        self.done = True
        run = statistics.median(self.seen)
        if run > DISAGREE * self.step_ms and runtime.cache_update(self.key, None):
            _say(
                f"{self.command}: this run's steps took {run:.3g} ms, {run / self.step_ms:.1f}x the {self.step_ms:.3g} "
                f"ms measured for {self.name}: those figures are dropped, the next run measures again"
            )


def watch(decision: Decision, model: GPT, device: torch.device, command: str) -> Optional[Watch]:
    """The Watch of a decision whose figures are in the cache (None otherwise: nothing to drop)."""
    t = (decision.timings or {}).get(decision.candidate.name)
    if env.probe_mode() == "0" or not isinstance(t, Timing) or t.step1 is None:
        return None
    key = cache_key(model.config, device, list(decision.timings))
    return Watch(key, decision.candidate.name, t.step1, command) if key in runtime.cached() else None


def announce(decision: Decision, command: str) -> None:
    """One stderr line: what was chosen and why, and that the threads sleep while they wait where the
    machine was busy as the command started (system/runtime.py's ``choose_wait``)."""
    wait = runtime.WAIT
    busy = f"; {wait.reason}" if wait is not None and wait.value == "PASSIVE" else ""
    _say(f"{command}: {decision.summary()}{busy}")


# -- the figures in the cache (system/runtime.py's): one entry per machine, device, model shape and candidate
# set (no workload: the dtype those figures decide is every workload's): each candidate's reference figures
# (or why it was dropped), the server's --max-batch-row step figures under ``rows``, what each workload chose
# under ``choices``, why figures measured on a busy machine were not kept under ``not_kept``.
SHAPE = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")  # what env shows of a model


def _write(key: str, model: GPT, device: torch.device, rows: Optional[int], figures=None, doubts=None) -> None:
    """Entry ``key``'s reference figures (``rows`` None: the entry made anew, its rows figures and choices, of
    other figures, going) or its ``rows``-row step figures, or, given ``doubts``, why the figures just measured
    were not kept (for ``gpt2lab env``; figures kept before stay, and are used)."""
    part = "rows" if rows else "reference"

    def change(entry: dict) -> None:
        if not entry or (figures is not None and not rows):
            entry.clear()
            entry.update(written=time.time(), model={f: getattr(model.config, f) for f in SHAPE}, device=str(device))
        notes = entry["not_kept"] = entry.get("not_kept") if isinstance(entry.get("not_kept"), dict) else {}
        if doubts is not None:
            notes[part] = {"written": time.time(), "why": doubts}
        elif rows:
            entry.setdefault("rows", {})[str(rows)] = {"written": time.time(), "timings": figures}
            notes.pop(part, None)
        else:
            entry["timings"] = as_json(figures)
        if not notes:
            del entry["not_kept"]

    runtime.cache_update(key, change)
