"""Measuring the inference candidates on this machine, for the CLI: the device's facts, then each
candidate timed on the model itself (a prefill of ``REQUEST_TOKENS`` tokens and decode steps at one row
and at the request's rows), cached per machine and model shape in one bounded file, announced on stderr
before it runs. ``decide`` hands the figures to inference/choice.py's ``choose``.

Only commands call this (``sample``, ``serve``, ``eval``, ``bench``): the library's ``for_inference``
takes the rule that needs no timing. ``GPT2LAB_PROBE=0`` skips the measuring (the device's rule
decides); ``GPT2LAB_PROBE=fresh`` measures again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import Optional

import torch

from gpt2lab.inference.choice import (
    REQUEST_TOKENS,
    Candidate,
    Decision,
    InferenceFacts,
    InferenceRequest,
    Timing,
    candidates,
    choose,
    device_pick,
)
from gpt2lab.inference.form import detect_facts, hold
from gpt2lab.model.gpt import GPT
from gpt2lab.system import formats, runtime

CONTEXT = 32  # tokens already cached when decode steps are timed
STEPS = 4  # decode steps per timed call
REPEATS = 3  # timed calls per figure (the best is kept), after one untimed
# A candidate whose untimed first call of a figure is this many times the best candidate's figure
# so far is dropped untimed: it cannot win (a cost sums the figures, each at least this far behind
# except one), and a kernel 20-50x off (int8 with fp32 activations on a Zen 5) would take most of
# the probe's time.
GIVE_UP = 10.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class _TooSlow(Exception):
    pass


def _best_ms(fn, device: torch.device, per_call: int = 1, limit: Optional[float] = None, what: str = "") -> float:
    """The best of REPEATS timed calls of ``fn`` in ms (per ``per_call``); _TooSlow, naming the figure
    ``what``, when the untimed first is over GIVE_UP times ``limit``."""
    t0 = time.perf_counter()
    fn()
    _sync(device)
    first = 1e3 * (time.perf_counter() - t0) / per_call
    if limit is not None and first > GIVE_UP * limit:
        raise _TooSlow(
            f"{what} {first:.3g} ms against the best candidate's {limit:.3g} ms (over {GIVE_UP:g}x): "
            "slower, not timed further"
        )
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times) / per_call


@torch.inference_mode()
def measure(
    model: GPT, cand: Candidate, request: InferenceRequest, device: torch.device, best: Optional[Timing] = None
) -> Timing:
    """The workload's figures for ``model`` held as ``cand``: a real prefill and real decode steps
    (given the ``best`` figures so far, a candidate far behind is given up: _TooSlow)."""
    best = best or Timing()
    prepared = hold(model, cand, request.rows)
    block, vocab = model.config.block_size, model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = min(REQUEST_TOKENS, block)
    ids = torch.randint(0, vocab, (1, prompt), generator=gen).to(device)
    prefill = _best_ms(
        lambda: prepared(ids, kv_cache=prepared.new_kv_cache(prompt), last_only=True),
        device,
        limit=best.prefill,
        what="prefill",
    )
    if request.workload == "score":
        return Timing(prefill=prefill)
    context = min(CONTEXT, max(1, block // 4))
    steps = max(1, min(STEPS, (block - context) // (REPEATS + 1)))

    def decode_ms(rows: int, limit: Optional[float]) -> float:
        cache = prepared.new_kv_cache(min(block, context + steps * (REPEATS + 1)))
        prepared(torch.randint(0, vocab, (rows, context), generator=gen).to(device), kv_cache=cache)
        tok = torch.randint(0, vocab, (rows, 1), generator=gen).to(device)

        def run() -> None:
            for _ in range(steps):
                prepared(tok, kv_cache=cache, last_only=True)

        return _best_ms(run, device, steps, limit, "step" if rows == 1 else f"{rows}-row step")

    step1 = decode_ms(1, best.step1)
    return Timing(prefill, step1, decode_ms(request.rows, best.step_rows) if request.workload == "serve" else None)


# The probe's figures, one entry per (machine, device, model shape, workload, candidates), all in one
# file; past this many entries the oldest written goes (a day of tests builds dozens of shapes).
PROBE_FILE = "decode-probes.json"
PROBE_ENTRIES = 32


def _probe_key(model: GPT, request: InferenceRequest, device: torch.device, names: list[str]) -> str:
    parts = [
        runtime._machine_key(),
        str(device),
        json.dumps(dataclasses.asdict(model.config), sort_keys=True),
        request.workload,
        str(request.rows),
        ",".join(sorted(names)),
        str(REQUEST_TOKENS),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _read_probes(path: str) -> dict:
    """The cache file's entries ({key: {"written": time, "timings": {...}}}); {} if absent, unreadable or
    of another format version."""
    try:
        with open(path) as fh:
            data = json.load(fh)
        entries = data.get("entries", {}) if formats.is_current(data, formats.PROBES, key="version") else {}
        return entries if isinstance(entries, dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}


def _save_probe(path: str, key: str, figures: dict) -> None:
    """Add one entry (the oldest go past PROBE_ENTRIES), written atomically. A read-only cache is no
    harm: the probe runs again next time."""
    from gpt2lab.system.files import write_json

    entries = _read_probes(path)
    entries[key] = {"written": time.time(), "timings": figures}
    keep = sorted(entries, key=lambda k: entries[k].get("written", 0) if isinstance(entries[k], dict) else 0)
    entries = {k: entries[k] for k in keep[-PROBE_ENTRIES:]}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json(path, {"version": formats.PROBES.version, "entries": entries}, indent=None)
    except OSError:
        pass


def _cached(path: str, key: str) -> Optional[dict]:
    entry = _read_probes(path).get(key)
    try:
        return {k: Timing(**v) if isinstance(v, dict) else str(v) for k, v in entry["timings"].items()}
    except (TypeError, KeyError, AttributeError):
        return None


@torch.inference_mode()
def estimate_seconds(model: GPT, n_candidates: int, request: InferenceRequest, device: torch.device) -> float:
    """About how long ``timings`` takes: one prefill and one decode step of ``model`` as it is, timed
    here, times the calls ``measure`` makes per candidate (a rough figure for the notice)."""
    block, vocab = model.config.block_size, model.config.vocab_size
    prompt = max(1, min(REQUEST_TOKENS, block - 1))  # and room for one decode step after it
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    model(ids[:, :1], last_only=True)  # untimed: the first touch of freshly loaded (mapped) weights
    _sync(device)
    cache = model.new_kv_cache(min(block, prompt + 1))
    t0 = time.perf_counter()
    model(ids, kv_cache=cache, last_only=True)
    _sync(device)
    t1 = time.perf_counter()
    if prompt < block:
        model(ids[:, :1], kv_cache=cache, last_only=True)
        _sync(device)
    prefill, step = t1 - t0, time.perf_counter() - t1
    per = (1 + REPEATS) * (prefill + STEPS * step) + prefill * CONTEXT / prompt
    if request.workload == "serve":
        per += (1 + REPEATS) * STEPS * (step + prefill * request.rows / prompt)
    return n_candidates * per


def _notice(
    command: str, model: GPT, cands: list[Candidate], request: InferenceRequest, device: torch.device, where: str
) -> None:
    """The one stderr line before the probe: what it does, about how long, and that it is done once."""
    secs = estimate_seconds(model, len(cands), request, device)
    about = f"about {secs:.0f} s" if secs >= 1 else "under a second"
    print(
        f"{command}: measuring {len(cands)} ways to run this model on this machine for {request.workload} "
        f"({', '.join(c.name for c in cands)}), {about}; done once per machine and model shape "
        f"(kept in {where}; GPT2LAB_PROBE=0 skips it)",
        file=sys.stderr,
        flush=True,
    )


def timings(
    model: GPT,
    cands: list[Candidate],
    request: InferenceRequest,
    device: torch.device,
    cache: bool = True,
    command: str = "gpt2lab",
) -> Optional[dict]:
    """Each candidate's Timing (or the error it failed with), from the cache when it can; None with
    GPT2LAB_PROBE=0; GPT2LAB_PROBE=fresh measures again (a probe taken on a busy machine) and keeps that.
    Before measuring, one line on stderr says so (``command`` first)."""
    mode = os.environ.get("GPT2LAB_PROBE", "1")
    if mode == "0":
        return None
    names = [c.name for c in cands]
    path, key = os.path.join(runtime._cache_dir(), PROBE_FILE), _probe_key(model, request, device, names)
    if cache and mode != "fresh":
        found = _cached(path, key)
        if found is not None:
            return found
    _notice(command, model, cands, request, device, path)
    out: dict = {}
    for c in cands:
        done = [t for t in out.values() if isinstance(t, Timing)]
        best = Timing(
            *(
                min((getattr(t, f) for t in done if getattr(t, f) is not None), default=None)
                for f in ("prefill", "step1", "step_rows")
            )
        )
        try:
            out[c.name] = measure(model, c, request, device, best)
        except _TooSlow as e:
            out[c.name] = f"given up: {e}"
        except (RuntimeError, NotImplementedError) as e:  # a kernel this build cannot run with these weights
            out[c.name] = f"failed: {str(e).splitlines()[0][:160]}"
    if cache:
        _save_probe(path, key, {k: dataclasses.asdict(v) if isinstance(v, Timing) else v for k, v in out.items()})
    return out


def decide(
    model: GPT,
    device: torch.device,
    request: InferenceRequest,
    facts: Optional[InferenceFacts] = None,
    command: str = "gpt2lab",
) -> Decision:
    """Measure (where there is a choice; a first measurement says so on stderr, ``command`` first) and choose."""
    facts = facts or detect_facts(device)
    cands = candidates(request, facts)
    if len(cands) > 1:  # the device rule's pick first: the likeliest winner sets the bar to give up at
        first = device_pick(cands, facts)
        cands = [first] + [c for c in cands if c != first]
        facts = dataclasses.replace(facts, timings=timings(model, cands, request, device, command=command))
    return choose(request, facts)


def announce(decision: Decision, command: str) -> None:
    """One stderr line: what was chosen and why."""
    print(f"{command}: {decision.summary()}", file=sys.stderr, flush=True)
