"""The inference choice: which (compute dtype, linear kernel) runs a model for a workload, as a pure
function of the request and the facts (the device's, and the timings when measured; inference/probe.py
gathers them). Tested with faked facts.

Training's dtype choice (system/runtime.py) answers "which dtype makes a large matmul fastest";
decoding is another workload. At 1 to 16 rows a step is bound by reading the weights, so for
``sample``, ``serve``, ``eval`` and ``gpt2lab.for_inference`` the weights are held once in the chosen
form (kernels.py):

* the candidates are the (compute dtype, kernel) pairs the device can run and the request
  allows (``candidates``): on a CPU fp32 and bf16, each with the plain, column-major and
  oneDNN-packed linears, bf16 also upcast and, where gpt2lab's compiled GEMV runs, ``gemv``;
  int8 weights with fp32 or bf16 activations under ``--quantize int8`` (PyTorch's int8 kernel;
  with fp32 ones gpt2lab's compiled GEMV too, where it was built);
  on a GPU fp32 and bf16 (fp16 without bf16); on MPS fp32 and fp16;
* ``choose`` decides in two steps. The **dtype** is one per model and machine, whatever the
  workload (``cheapest_dtype``): the dtype whose best kernel serves the reference request cheapest,
  ``REQUEST_TOKENS`` prompt tokens and as many new ones at one row (prefill + 128 one-row steps), so
  ``sample``, ``serve``, the evals and ``for_inference(dtype="auto")`` hold the same precision and a
  seeded request gives the same text in each. The **kernel** within that dtype is the cheapest
  measured for the workload: ``sample`` that same request; ``serve`` it at one row and at a full
  batch, the kernel whose worse slowdown against the best of either is smallest; ``score`` (the
  evals) the prefill alone. Unmeasured, the device's rule decides (``rule``): the documented choice
  that needs no timing, which the library's ``for_inference`` uses when nothing was measured.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from gpt2lab.system import runtime
from gpt2lab.system.choices import LINEAR_CHOICES, QUANTIZE_CHOICES
from gpt2lab.system.runtime import ChoiceError, Facts

WORKLOADS = ("sample", "serve", "score")
# The request the costs describe: this many prompt tokens, then as many new ones (sample's default
# asks for 100). A constant of the cost model, not a speed tuning: it weighs prefill (compute-bound)
# against decoding (bandwidth-bound) as a typical completion does, on any machine.
REQUEST_TOKENS = 128
# The rows of the reference batch step, the dtype's second figure: the batch `gpt2lab serve` runs with
# its default limits (--max-batch 16). A fixed size, so every command reads the same figures and picks
# the same dtype; where one dtype leads at one row and another at a batch (a CPU that emulates bf16
# matmuls: its bf16 weights read half the bytes, its 16-row bf16 steps compute slowly), the dtype
# whose worse case is the least behind is every workload's.
BATCH_ROWS = 16


@dataclass(frozen=True)
class Candidate:
    dtype: str  # compute dtype of the linears: float32, bfloat16, float16
    kernel: str  # kernels.KERNELS

    @property
    def name(self) -> str:
        return f"{self.dtype}/{self.kernel}"

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Timing:
    """Measured ms: a prefill of REQUEST_TOKENS tokens, a decode step at one row, at the request's rows
    (serve's --max-batch) and at BATCH_ROWS rows (measured for each dtype's best kernel); and, for the
    ``gemv`` kernel, up to how many rows a product goes through its compiled tiles rather than a matmul
    (upcast's fp32 one, or oneDNN's bf16 one: ``gemv_bf16_inputs``): ``tile_rows``, from the prefill timed
    both ways at two lengths (``crossover``)."""

    prefill: Optional[float] = None
    step1: Optional[float] = None
    step_rows: Optional[float] = None
    step_batch: Optional[float] = None
    tile_rows: Optional[int] = None


def as_json(figures: dict) -> dict:
    """Candidate name -> Timing (or why it was dropped) as JSON values."""
    return {k: dataclasses.asdict(v) if isinstance(v, Timing) else v for k, v in figures.items()}


def tile_rows_of(t) -> int:
    """Up to how many rows a candidate's figures ``t`` (a Timing, or why it was dropped) hold its ``gemv``
    linears' compiled tiles: 1 where none were measured."""
    return t.tile_rows if isinstance(t, Timing) and t.tile_rows else 1


@dataclass(frozen=True)
class InferenceRequest:
    """What the command asked for (``dtype`` "auto" or a dtype name; ``rows``: the server's --max-batch)."""

    dtype: str = "auto"
    quantize: str = "none"
    linear: str = "auto"
    workload: str = "sample"
    rows: int = 1


@dataclass(frozen=True)
class Decision:
    candidate: Candidate
    reason: str
    request: InferenceRequest
    timings: Optional[dict] = None
    # gemv on a CPU that computes bf16 natively: every product's inputs rounded to bf16 (form.hold follows the
    # same fact: gemv_bf16_inputs); in panels where the compiled AVX512_BF16 routines run (a panel hold:
    # every row count by them), else row-major, a prompt past the tiles by oneDNN's bf16 matmul
    bf16_inputs: bool = False
    panels: bool = False

    @property
    def tile_rows(self) -> int:
        """Up to how many rows the chosen ``gemv`` linears multiply by their compiled tiles (1 unmeasured)."""
        return tile_rows_of((self.timings or {}).get(self.candidate.name))

    def summary(self) -> str:
        """One short line: what was chosen and why (every figure: ``record`` and ``gpt2lab env``)."""
        tiles = f", several rows by its tiles up to {self.tile_rows}" if self.tile_rows > 1 else ""
        if self.bf16_inputs:
            tiles += ", inputs rounded to bf16" + (", weights in panels" if self.panels else "")
        t, why = (self.timings or {}).get(self.candidate.name), self.reason
        if isinstance(t, Timing) and _has(t, "prefill"):  # measured: its own figures, the others' in gpt2lab env
            ways = sum(isinstance(v, Timing) for v in self.timings.values())
            why = f"measured for {self.request.workload}: {_figures(self.request, t)} ms, the pick of {ways} ways"
        return f"dtype {self.candidate.dtype}, {self.candidate.kernel} linears{tiles} ({why})"

    def record(self) -> dict:
        """The figures behind the choice, for JSON outputs."""
        return {
            **dataclasses.asdict(self.candidate),  # dtype, kernel
            "tile_rows": self.tile_rows,
            **{field: getattr(self, field) for field in ("bf16_inputs", "panels", "reason")},
            **{field: getattr(self.request, field) for field in ("workload", "rows", "quantize")},
            "timings_ms": as_json(self.timings or {}),
            "threads_wait": runtime.WAIT.reason if runtime.WAIT else None,  # as the command started
        }


def _dtypes(request: InferenceRequest, facts: Facts) -> list[str]:
    if request.dtype != "auto":  # the device must run it: training's checks, one place
        return [str(runtime.choose_dtype(request.dtype, facts).value)]
    half = {"cuda": "bfloat16" if facts.native_bf16 else "float16", "mps": "float16"}.get(facts.device_type, "bfloat16")
    return ["float32", half]


def candidates(request: InferenceRequest, facts: Facts) -> list[Candidate]:
    """The (dtype, kernel) pairs this device can run that the request allows; an impossible ask is a ChoiceError."""
    if request.workload not in WORKLOADS:
        raise ValueError(f"workload {request.workload!r}: one of {', '.join(WORKLOADS)}")
    for flag, value, allowed in (
        ("--quantize", request.quantize, QUANTIZE_CHOICES),
        ("--cpu-linear", request.linear, LINEAR_CHOICES),
    ):
        if value not in allowed:
            raise ChoiceError(f"{flag} {value}: choose one of {', '.join(allowed)}")
    dtypes, cpu = _dtypes(request, facts), facts.device_type == "cpu"
    gemv, packing = (cpu and facts.cannot(k) is None for k in ("gemv", "packed"))
    if request.quantize == "int8":
        if why := facts.cannot("int8"):
            raise ChoiceError(f"--quantize int8 cannot run here: {why}; leave --quantize out")
        kernels = ["int8"] + ["int8-gemv"] * gemv
    elif request.linear == "packed" and not packing:
        why = "this torch build has no oneDNN packed linear" if cpu else f"{facts.device_type} has no oneDNN"
        raise ChoiceError(f"--cpu-linear packed cannot run here ({why}); use auto or plain")
    elif not cpu:
        kernels = ["plain"]
    else:
        auto = ["plain", "decode", "upcast"] + ["gemv"] * gemv + ["packed"] * packing
        kernels = {"auto": auto, "plain": ["plain", "decode"], "packed": ["packed"]}[request.linear]
    # fp32 weights need no converting; int8-gemv computes in fp32
    skip = {("float32", "upcast"), ("float32", "gemv"), ("bfloat16", "int8-gemv"), ("float16", "int8-gemv")}
    skip |= {("bfloat16", "packed")} if facts.cannot("bfloat16/packed") else set()
    out = [Candidate(d, k) for d in dtypes for k in kernels if (d, k) not in skip]
    if not out:  # only bf16 packed was asked for, and oneDNN cannot pack bf16 on this CPU
        raise ChoiceError(
            f"--dtype bfloat16 --cpu-linear packed cannot run here (oneDNN: "
            f"{facts.cannot('bfloat16/packed')}); use --cpu-linear plain or --dtype float32"
        )
    return out


def reference_cost(t: Timing, step: Optional[float] = None, rows: int = 1) -> float:
    """The cost in ms of the reference request: its prefill and REQUEST_TOKENS steps, one-row ones (the
    dtype's figure) or, given their ``step`` ms, its share of steps of ``rows`` rows."""
    return t.prefill + REQUEST_TOKENS * (t.step1 if step is None else step) / rows


def costs(request: InferenceRequest, t: Timing) -> tuple[float, ...]:
    """The workload's cost(s) in ms of a candidate's timing (lower is better): the kernel's figure."""
    if request.workload == "score":
        return (t.prefill,)
    if request.workload == "sample" or t.step_rows is None:
        return (reference_cost(t),)
    return reference_cost(t), reference_cost(t, t.step_rows, request.rows)  # serve: one row, and a full batch


def _has(t, *fields: str) -> bool:
    return isinstance(t, Timing) and all(getattr(t, f) is not None for f in fields)


def crossover(short: tuple[float, float], long: tuple[float, float], lengths: tuple[int, int]) -> int:
    """Up to how many rows the ``gemv`` kernel's compiled tiles multiply: from its prefill timed both ways,
    (matmul ms, tiles ms), at each of two prompt lengths (``lengths``, the shorter first); the matmul is
    upcast's, or oneDNN's bf16 one where the hold takes it (``gemv_bf16_inputs``). Each way is taken as a
    straight line in the length (the matmul: a fixed cost (upcast: the weights widened once), then a cost
    a row; the tiles: each row's products, no fixed pass), and the answer is the longest length, from 1 to
    the longer one measured (never further than measured), at which the tiles' line is not above the
    matmul's: where they cross is the machine's (an AVX2 EPYC against upcast: about 60 tokens; a Zen 4
    against the bf16 matmul: about 12), so it is measured, not set."""
    (s, r), (u_s, c_s), (u_r, c_r) = lengths, short, long
    ahead_s, ahead_r = u_s - c_s, u_r - c_r  # the tiles' lead at each length (ms)
    slope = (ahead_r - ahead_s) / (r - s)
    if slope >= 0:
        return r if ahead_s >= 0 else 1
    return int(max(1, min(r, math.floor(s + ahead_s / -slope))))


def cheapest_dtype(cands: list[Candidate], facts: Facts) -> tuple[str, str]:
    """(The dtype every workload holds ``cands``' model in, why). Each measured dtype is represented by its
    kernel cheapest for the reference request (prefill and one-row steps); where every such kernel also has
    its BATCH_ROWS-row figure, the dtype is the one whose worse slowdown against the best dtype, at one row
    and in a full batch, is the least (ties: the cheaper at one row); else the cheapest at one row.
    Unmeasured: the device's rule. No workload enters it."""
    timings = facts.timings or {}
    best: dict[str, Timing] = {}
    for c in cands:
        t = timings.get(c.name)
        if _has(t, "prefill", "step1") and (c.dtype not in best or reference_cost(t) < reference_cost(best[c.dtype])):
            best[c.dtype] = t
    if not best:
        return device_pick(cands, facts).dtype, _unmeasured_reason(facts)
    both = len(best) > 1 and all(t.step_batch is not None for t in best.values())
    batch = {d: (reference_cost(t, t.step_batch, BATCH_ROWS),) if both else () for d, t in best.items()}
    cost = {d: (reference_cost(t), *batch[d]) for d, t in best.items()}
    what = f"a {REQUEST_TOKENS}-token prefill and {REQUEST_TOKENS} steps at one row" + (
        f" / in a {BATCH_ROWS}-row batch" if both else ""
    )
    figures = {d: " / ".join(f"{v:.1f}" for v in c) for d, c in cost.items()}
    return _least_behind(cost, f"the dtype for every workload, the least behind ({what})", figures)


def _least_behind(cost: dict, what: str, figures: dict) -> tuple:
    """(The key of ``cost`` (key -> tuple of costs in ms, of one length) whose worse slowdown against the least
    of each cost is the smallest (ties: the cheaper first cost, then the name), why: ``what``, its ``figures``
    (key -> text, in ms) and, of the next three, theirs and that slowdown)."""
    least = [min(c) for c in zip(*cost.values())]
    slow = {k: max(v / low for v, low in zip(c, least)) for k, c in cost.items()}
    pick, *others = sorted(cost, key=lambda k: (slow[k], cost[k][0], str(k)))
    against = "".join(f"; against {k} {figures[k]} ms ({slow[k]:.2f}x)" for k in others[:3])
    return pick, f"{what}: {pick} {figures[pick]} ms{against}"


def choose(request: InferenceRequest, facts: Facts) -> Decision:
    """The candidate for ``request``: the only one; else the dtype (``cheapest_dtype``, the same for every
    workload) and, of its kernels, the one least behind as measured for the workload (``costs``), or
    (unmeasured) the device's rule."""
    cands = candidates(request, facts)
    if len(cands) == 1:
        pick = cands[0]
        why = "asked for" if request.dtype != "auto" or request.quantize != "none" else "the only one here"
    else:
        # an asked-for dtype: only the kernel is left to choose
        dtype, dtype_why = (cands[0].dtype, "") if len({c.dtype for c in cands}) == 1 else cheapest_dtype(cands, facts)
        pool = [c for c in cands if c.dtype == dtype]
        need = ("prefill",) if request.workload == "score" else ("prefill", "step1")
        timings = facts.timings or {}
        measured = {c: timings[c.name] for c in pool if _has(timings.get(c.name), *need)}
        if request.workload == "serve" and any(t.step_rows is not None for t in measured.values()):
            measured = {c: t for c, t in measured.items() if t.step_rows is not None}  # one cost for them all
        if measured:
            what = f"the kernel least behind as measured for {request.workload}"
            shown = {c: _figures(request, t) for c, t in measured.items()}
            pick, why = _least_behind({c: costs(request, t) for c, t in measured.items()}, what, shown)
            dropped = [f"{n} {t}" for n, t in timings.items() if not isinstance(t, Timing)]  # t: why
            why += f"; dropped: {'; '.join(dropped)}" if dropped else ""
        else:
            pick, why = device_pick(pool, facts), _unmeasured_reason(facts)
        why = why if dtype_why in ("", why) else f"{dtype_why}; {why}"
    rounded = pick.kernel == "gemv" and gemv_bf16_inputs(facts)
    return Decision(pick, why, request, facts.timings, rounded, rounded and not facts.cannot("panels"))


def gemv_bf16_inputs(facts: Facts) -> bool:
    """Whether a ``gemv`` hold rounds every product's inputs to bf16, so that its products are bf16 ones (in
    panels, by the compiled AVX512_BF16 dot product at every row count, where those routines run; else a
    prompt past the tiles by oneDNN's bf16 matmul): where the CPU computes bf16 natively (AVX512_BF16,
    AMX), as its bf16 matmuls are 2x or more fp32's, the fact the training dtype rests on (a Zen 4: a
    128-token prefill 1.9x upcast's); elsewhere bf16 matmuls are emulated, slower than fp32, and the
    inputs stay fp32."""
    return facts.device_type == "cpu" and facts.native_bf16


def device_pick(cands: list[Candidate], facts: Facts) -> Candidate:
    """The device's rule: half precision where the device computes it natively, or where gpt2lab's
    compiled GEMV holds it (``gemv``), of those dtypes the candidates hold (an asked-for dtype is the only
    one); fp32 on a CPU without either, and on MPS. Then ``gemv`` first where it runs (its one row reads
    the bf16 bytes at the read's pace in one call a token; on a CPU without native bf16 several rows are
    its fp32 tiles, not emulated bf16 matmuls: on an AVX2-only EPYC 2.46x faster than fp32 at one row and
    1.4-2.2x in a 16-row batch; with native bf16 the weights in panels, every row count AVX512_BF16 dot
    products: on a Zen 4 its step 2.2x oneDNN's packed bf16 linear's at one row, at 16 rows 17.2 against
    33.7 ms, a 128-token prefill 76 against 81 ms), then oneDNN's packed linear; for fp32
    weights the column-major layout, for half-precision ones the row-major (a column-major bf16 weight
    was 1.4x slower than row-major on a Zen 5 with AVX512_BF16, and 20x on an AVX2-only EPYC; fp32
    gained 1.2x from it on both); an asked-for half precision on a CPU without native bf16 that neither
    oneDNN nor gpt2lab's GEMV holds takes ``upcast``, whose several-row products are fp32 ones (a
    128-token prefill 1.2 s in bf16, 0.2 s upcast, on that EPYC). Int8 weights in fp32 take gpt2lab's
    compiled GEMV where it runs (``int8-gemv``: on that EPYC it read them at ~12 GB/s, PyTorch's int8
    kernel at ~1.3 with fp32 activations)."""
    half = [c for c in cands if c.dtype != "float32"]
    fp32 = [c for c in cands if c.dtype == "float32"]
    emulated = facts.device_type == "cpu" and not facts.native_bf16  # its half-precision matmuls emulated
    gemv = any(c.kernel == "gemv" for c in half)
    prefer_fp32 = facts.device_type == "mps" or (emulated and not gemv)
    pool = (fp32 if prefer_fp32 else half) or cands
    if pool[0].dtype == "float32":
        order = ("packed", "decode", "int8-gemv", "int8", "plain")
    elif emulated:
        order = ("gemv", "packed", "upcast", "int8", "plain", "decode")
    else:
        order = ("gemv", "packed", "int8", "plain", "decode", "upcast")
    return min(pool, key=lambda c: order.index(c.kernel) if c.kernel in order else len(order))


def _unmeasured_reason(facts: Facts) -> str:
    if facts.device_type != "cpu":
        return f"not measured; {facts.device_type}: half precision reads half the bytes"
    found = ["native bf16 on this CPU" if facts.native_bf16 else "no native bf16 on this CPU"]
    named = {"packed": "oneDNN packed linears", "gemv": "gpt2lab's compiled GEMV"}
    found += [what for kernel, what in named.items() if not facts.cannot(kernel)]
    return "not measured; " + ", ".join(found)


def _figures(request: InferenceRequest, t: Timing) -> str:
    """The figures of ``t`` that ``request``'s workload is chosen by (ms)."""
    parts = [f"prefill {t.prefill:.1f}"]
    if request.workload != "score" and t.step1 is not None:
        parts.append(f"step {t.step1:.2f}")
    if request.workload == "serve" and t.step_rows is not None:
        parts.append(f"{request.rows}-row step {t.step_rows:.2f}")
    return " / ".join(parts)


def rule(request: InferenceRequest, facts: Facts) -> Decision:
    """The choice without timing: ``choose`` with the facts' timings left out (the device's rule)."""
    return choose(request, dataclasses.replace(facts, timings=None))
