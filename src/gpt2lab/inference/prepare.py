"""A model prepared for inference: precision and kernels decided for the inference workload.

Training's dtype choice (system/runtime.py) answers "which dtype makes a large matmul
fastest"; decoding is another workload. At 1 to 16 rows a step is bound by reading the
weights, and autocast reads fp32 weights and casts them again at every step: on a Zen 4 with
AVX512_BF16, where training rightly picks bf16, autocast decoding ran at half the fp32 speed.
So for ``sample``, ``serve``, ``eval`` and ``generate()`` the weights are held once in the
chosen form (kernels.py) and the choice is measured on the workload itself:

* the candidates are the (compute dtype, kernel) pairs the device can run and the request
  allows (``candidates``): on a CPU fp32 and bf16, each with the plain, column-major and
  oneDNN-packed linears; int8 weights with fp32 or bf16 activations under ``--quantize int8``;
  on a GPU fp32 and bf16 (fp16 without bf16); on MPS fp32 and fp16;
* each is timed on this model, on this machine (``measure``): a prefill of
  ``REQUEST_TOKENS`` tokens and decode steps at one row and at the request's rows, the
  numbers the workload needs; the figures are cached per machine and model shape like the
  training probe, so a command pays for them once;
* ``choose`` (a pure function of the request and those facts, tested with faked ones) keeps
  the cheapest for the workload: ``sample`` a request of ``REQUEST_TOKENS`` prompt tokens and as
  many new ones at one row; ``serve`` the same at one row and at a full batch, the candidate
  whose worse slowdown against the best of either is smallest; ``score`` (the evals) the
  prefill alone.

Every command prints the decision and records its figures. ``GPT2LAB_PROBE=0`` skips the
measuring (the device's facts decide, as they would for training).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Optional

import torch

from gpt2lab.inference.kernels import int8_available, packing_available, packing_bf16_error, swap_linears
from gpt2lab.model.gpt import GPT
from gpt2lab.model.loss import LossPath
from gpt2lab.system import runtime
from gpt2lab.system.choices import LINEAR_CHOICES, QUANTIZE_CHOICES
from gpt2lab.system.runtime import ChoiceError

WORKLOADS = ("sample", "serve", "score")
# The request the costs describe: this many prompt tokens, then as many new ones (sample's default
# asks for 100). A constant of the cost model, not a speed tuning: it weighs prefill (compute-bound)
# against decoding (bandwidth-bound) as a typical completion does, on any machine.
REQUEST_TOKENS = 128
CONTEXT = 32        # tokens already cached when decode steps are timed
STEPS = 4           # decode steps per timed call
REPEATS = 3         # timed calls per figure (the best is kept), after one untimed
# A candidate whose untimed first call of a figure is this many times the best candidate's figure
# so far is dropped untimed: it cannot win (a cost sums the figures, each at least this far behind
# except one), and a kernel 20-50x off (int8 with fp32 activations on a Zen 5) would take most of
# the probe's time.
GIVE_UP = 10.0


@dataclass(frozen=True)
class Candidate:
    dtype: str      # compute dtype of the linears: float32, bfloat16, float16
    kernel: str     # kernels.KERNELS

    @property
    def name(self) -> str:
        return f"{self.dtype}/{self.kernel}"


@dataclass(frozen=True)
class Timing:
    """Measured ms: a prefill of REQUEST_TOKENS tokens, a decode step at one row and at the request's rows."""
    prefill: Optional[float] = None
    step1: Optional[float] = None
    step_rows: Optional[float] = None


@dataclass(frozen=True)
class InferenceRequest:
    """What the command asked for (``dtype`` "auto" or a dtype name; ``rows``: the server's --max-batch)."""
    dtype: str = "auto"
    quantize: str = "none"
    linear: str = "auto"
    workload: str = "sample"
    rows: int = 1


@dataclass(frozen=True)
class InferenceFacts:
    """What the decision depends on; ``detect_facts`` fills the device's, ``measure`` the timings."""
    device_type: str
    device_name: str = ""
    native_bf16: bool = False               # CPU flag (AVX512_BF16/AMX/BF16) or the GPU's bf16
    packing: bool = False                   # oneDNN's packed linear is there (CPU)
    packing_bf16_error: Optional[str] = None  # why oneDNN cannot pack bf16 weights here (None: it can)
    int8_error: Optional[str] = None        # why int8 weight-only cannot run (None: it can)
    timings: Optional[dict] = None          # candidate name -> Timing, or -> the error it failed with


@dataclass(frozen=True)
class Decision:
    candidate: Candidate
    reason: str
    request: InferenceRequest
    timings: Optional[dict] = None

    def summary(self) -> str:
        return f"dtype {self.candidate.dtype}, {self.candidate.kernel} linears ({self.reason})"

    def record(self) -> dict:
        """The figures behind the choice, for JSON outputs."""
        return {"dtype": self.candidate.dtype, "kernel": self.candidate.kernel, "reason": self.reason,
                "workload": self.request.workload, "rows": self.request.rows, "quantize": self.request.quantize,
                "timings_ms": {k: (dataclasses.asdict(v) if isinstance(v, Timing) else v)
                               for k, v in (self.timings or {}).items()}}


# -- the choice: pure functions of (request, facts) --------------------------------------
def _dtypes(request: InferenceRequest, facts: InferenceFacts) -> list[str]:
    dev = facts.device_type
    if request.dtype != "auto":  # the device must run it: training's checks, one place
        rf = runtime.Facts(dev, facts.device_name, cuda_bf16=facts.native_bf16 if dev == "cuda" else False)
        return [str(runtime.choose_dtype(request.dtype, rf).value)]
    if dev == "cuda":
        return ["float32", "bfloat16" if facts.native_bf16 else "float16"]
    if dev == "mps":
        return ["float32", "float16"]
    return ["float32", "bfloat16"]


def candidates(request: InferenceRequest, facts: InferenceFacts) -> list[Candidate]:
    """The (dtype, kernel) pairs this device can run that the request allows; an impossible ask is a ChoiceError."""
    if request.workload not in WORKLOADS:
        raise ValueError(f"workload {request.workload!r}: one of {', '.join(WORKLOADS)}")
    if request.quantize not in QUANTIZE_CHOICES:
        raise ChoiceError(f"--quantize {request.quantize}: choose one of {', '.join(QUANTIZE_CHOICES)}")
    if request.linear not in LINEAR_CHOICES:
        raise ChoiceError(f"--cpu-linear {request.linear}: choose one of {', '.join(LINEAR_CHOICES)}")
    dtypes = _dtypes(request, facts)
    cpu = facts.device_type == "cpu"
    if request.quantize == "int8":
        if facts.int8_error:
            raise ChoiceError(f"--quantize int8 cannot run here: {facts.int8_error}; leave --quantize out")
        return [Candidate(d, "int8") for d in dtypes]
    if request.linear == "packed" and not (cpu and facts.packing):
        why = "this torch build has no oneDNN packed linear" if cpu else f"{facts.device_type} has no oneDNN"
        raise ChoiceError(f"--cpu-linear packed cannot run here ({why}); use auto or plain")
    if not cpu:
        return [Candidate(d, "plain") for d in dtypes]
    kernels = {"auto": ["plain", "decode"] + (["packed"] if facts.packing else []),
               "plain": ["plain", "decode"], "packed": ["packed"]}[request.linear]
    out = [Candidate(d, k) for d in dtypes for k in kernels
           if not (k == "packed" and d == "bfloat16" and facts.packing_bf16_error)]
    if not out:  # only bf16 packed was asked for, and oneDNN cannot pack bf16 on this CPU
        raise ChoiceError(f"--dtype bfloat16 --cpu-linear packed cannot run here (oneDNN: "
                          f"{facts.packing_bf16_error}); use --cpu-linear plain or --dtype float32")
    return out


def costs(request: InferenceRequest, t: Timing) -> tuple[float, ...]:
    """The workload's cost(s) in ms of a candidate's timing (lower is better)."""
    if request.workload == "score":
        return (t.prefill,)
    one = t.prefill + REQUEST_TOKENS * t.step1
    if request.workload == "sample":
        return (one,)
    return one, t.prefill + REQUEST_TOKENS * t.step_rows / request.rows  # serve: one row, and a full batch


def choose(request: InferenceRequest, facts: InferenceFacts) -> Decision:
    """The candidate for ``request``: the only one, the cheapest measured, or (unmeasured) the device's rule."""
    cands = candidates(request, facts)
    if len(cands) == 1:
        why = "asked for" if request.dtype != "auto" or request.quantize != "none" else "the only one here"
        return Decision(cands[0], why, request, facts.timings)
    measured = {c: facts.timings[c.name] for c in cands
                if facts.timings and isinstance(facts.timings.get(c.name), Timing)}
    if not measured:
        return Decision(_unmeasured(cands, facts), _unmeasured_reason(facts), request, facts.timings)
    cost = {c: costs(request, t) for c, t in measured.items()}
    best = [min(v[i] for v in cost.values()) for i in range(len(next(iter(cost.values()))))]
    slowdown = {c: max(v[i] / best[i] for i in range(len(best))) for c, v in cost.items()}
    pick = min(measured, key=lambda c: (slowdown[c], c.name))
    return Decision(pick, _measured_reason(request, pick, measured, slowdown, facts.timings), request, facts.timings)


def _unmeasured(cands: list[Candidate], facts: InferenceFacts) -> Candidate:
    half = [c for c in cands if c.dtype != "float32"]
    cpu_fp32 = facts.device_type == "cpu" and not facts.native_bf16
    pool = [c for c in cands if c.dtype == "float32"] if cpu_fp32 or facts.device_type == "mps" or not half else half
    for kernel in ("packed", "decode", "int8", "plain"):
        for c in pool:
            if c.kernel == kernel:
                return c
    return pool[0]


def _unmeasured_reason(facts: InferenceFacts) -> str:
    if facts.device_type == "cpu":
        return ("not measured; " + ("native bf16 on this CPU" if facts.native_bf16 else "no native bf16 on this CPU")
                + (", oneDNN packed linears" if facts.packing else ""))
    return f"not measured; {facts.device_type}: half precision reads half the bytes"


def _measured_reason(request: InferenceRequest, pick: Candidate, measured: dict, slowdown: dict,
                     timings: Optional[dict]) -> str:
    def fig(c: Candidate) -> str:
        t = measured[c]
        parts = [f"prefill {t.prefill:.1f}"]
        if request.workload != "score":
            parts.append(f"step {t.step1:.2f}")
        if request.workload == "serve":
            parts.append(f"{request.rows}-row step {t.step_rows:.2f}")
        return f"{c.name} {' / '.join(parts)} ms"

    others = sorted((c for c in measured if c != pick), key=lambda c: slowdown[c])
    text = f"fastest measured for {request.workload}: {fig(pick)}"
    if others:
        text += "; next " + "; ".join(f"{fig(c)} ({slowdown[c]:.2f}x)" for c in others[:3])
    dropped = [f"{n} {t}" for n, t in (timings or {}).items() if not isinstance(t, Timing)]  # t: why
    return text + (f"; dropped: {'; '.join(dropped)}" if dropped else "")


# -- the facts of this machine --------------------------------------------------------------
def detect_facts(device: torch.device) -> InferenceFacts:
    f = runtime.detect(device, probe=False)
    return InferenceFacts(device.type, f.device_name, native_bf16=f.native_bf16,
                          packing=(packing := device.type == "cpu" and packing_available()),
                          packing_bf16_error=packing_bf16_error() if packing else None,
                          int8_error=int8_available(device))


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
        raise _TooSlow(f"{what} {first:.3g} ms against the best candidate's {limit:.3g} ms (over {GIVE_UP:g}x): "
                       "slower, not timed further")
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times) / per_call


@torch.inference_mode()
def measure(model: GPT, cand: Candidate, request: InferenceRequest, device: torch.device,
            best: Optional[Timing] = None) -> Timing:
    """The workload's figures for ``model`` held as ``cand``: a real prefill and real decode steps
    (given the ``best`` figures so far, a candidate far behind is given up: _TooSlow)."""
    best = best or Timing()
    prepared = apply(model, cand, request.rows, inplace=False)
    block, vocab = model.config.block_size, model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = min(REQUEST_TOKENS, block)
    ids = torch.randint(0, vocab, (1, prompt), generator=gen).to(device)
    prefill = _best_ms(lambda: prepared(ids, kv_cache=prepared.new_kv_cache(prompt), last_only=True), device,
                       limit=best.prefill, what="prefill")
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
_LEGACY_PROBE = re.compile(r"^decode-probe-[0-9a-f]{16}\.json$")  # one file per shape, as older versions kept them


def _probe_key(model: GPT, request: InferenceRequest, device: torch.device, names: list[str]) -> str:
    parts = [runtime._machine_key(), str(device), json.dumps(dataclasses.asdict(model.config), sort_keys=True),
             request.workload, str(request.rows), ",".join(sorted(names)), str(REQUEST_TOKENS)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _read_probes(path: str) -> dict:
    """The cache file's entries ({key: {"written": time, "timings": {...}}}); {} if absent or unreadable."""
    try:
        with open(path) as fh:
            entries = json.load(fh).get("entries", {})
        return entries if isinstance(entries, dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}


def _save_probe(path: str, key: str, figures: dict) -> None:
    """Add one entry (the oldest go past PROBE_ENTRIES), written atomically; the per-shape files of
    older versions beside it go. A read-only cache is no harm: the probe runs again next time."""
    from gpt2lab.system.files import write_json

    entries = _read_probes(path)
    entries[key] = {"written": time.time(), "timings": figures}
    keep = sorted(entries, key=lambda k: entries[k].get("written", 0) if isinstance(entries[k], dict) else 0)
    entries = {k: entries[k] for k in keep[-PROBE_ENTRIES:]}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json(path, {"version": 1, "entries": entries}, indent=None)
        for name in os.listdir(os.path.dirname(path)):
            if _LEGACY_PROBE.match(name):
                os.unlink(os.path.join(os.path.dirname(path), name))
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


def _notice(command: str, model: GPT, cands: list[Candidate], request: InferenceRequest, device: torch.device,
            where: str) -> None:
    """The one stderr line before the probe: what it does, about how long, and that it is done once."""
    import sys

    secs = estimate_seconds(model, len(cands), request, device)
    about = f"about {secs:.0f} s" if secs >= 1 else "under a second"
    print(f"{command}: measuring {len(cands)} ways to run this model on this machine for {request.workload} "
          f"({', '.join(c.name for c in cands)}), {about}; done once per machine and model shape "
          f"(kept in {where}; GPT2LAB_PROBE=0 skips it)", file=sys.stderr, flush=True)


def timings(model: GPT, cands: list[Candidate], request: InferenceRequest, device: torch.device,
            cache: bool = True, command: str = "gpt2lab") -> Optional[dict]:
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
        best = Timing(*(min((getattr(t, f) for t in done if getattr(t, f) is not None), default=None)
                        for f in ("prefill", "step1", "step_rows")))
        try:
            out[c.name] = measure(model, c, request, device, best)
        except _TooSlow as e:
            out[c.name] = f"given up: {e}"
        except (RuntimeError, NotImplementedError) as e:  # a kernel this build cannot run with these weights
            out[c.name] = f"failed: {str(e).splitlines()[0][:160]}"
    if cache:
        _save_probe(path, key, {k: dataclasses.asdict(v) if isinstance(v, Timing) else v for k, v in out.items()})
    return out


# -- preparing a model ----------------------------------------------------------------------
def _shared_copy(model: GPT) -> GPT:
    """A copy of ``model``'s modules that shares every parameter with it (the linears are swapped next)."""
    memo = {id(p): p for p in model.parameters()}
    memo.update({id(b): b for b in model.buffers()})
    return copy.deepcopy(model, memo)


def apply(model: GPT, cand: Candidate, rows: int = 1, inplace: bool = False) -> GPT:
    """``model`` (or a copy sharing its other parameters) with every linear held as ``cand``; for inference only."""
    target = model if inplace else _shared_copy(model)
    swap_linears(target, cand.kernel, getattr(torch, cand.dtype), batch_hint=rows)
    target.eval()
    if inplace:  # a copy shares the model's other parameters: their requires_grad is the model's business
        target.requires_grad_(False)
    target.set_loss(LossPath(chunked=False))  # the chunked loss reads lm_head.weight, which a decode linear lacks
    target.decode = cand
    return target


def decide(model: GPT, device: torch.device, request: InferenceRequest,
           facts: Optional[InferenceFacts] = None, command: str = "gpt2lab") -> Decision:
    """Measure (where there is a choice; a first measurement says so on stderr, ``command`` first) and choose."""
    facts = facts or detect_facts(device)
    cands = candidates(request, facts)
    if len(cands) > 1:  # the device rule's pick first: the likeliest winner sets the bar to give up at
        first = _unmeasured(cands, facts)
        cands = [first] + [c for c in cands if c != first]
        facts = dataclasses.replace(facts, timings=timings(model, cands, request, device, command=command))
    return choose(request, facts)


def is_prepared(model: torch.nn.Module) -> bool:
    return getattr(model, "decode", None) is not None


def prepare(model: GPT, device: torch.device, request: InferenceRequest = InferenceRequest(),
            inplace: bool = False, command: str = "gpt2lab") -> tuple[GPT, Decision]:
    """``model`` prepared for ``request`` on ``device``: (the prepared model, the decision)."""
    decision = decide(model, device, request, command=command)
    return apply(model, decision.candidate, request.rows, inplace), decision


def announce(decision: Decision, command: str) -> None:
    """One stderr line: what was chosen and why."""
    import sys

    print(f"{command}: {decision.summary()}", file=sys.stderr, flush=True)
