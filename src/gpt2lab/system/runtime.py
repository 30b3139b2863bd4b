"""What this machine can do, and the dtype and compile choices that follow from it.

No default is tuned to one machine: ``--dtype auto`` and ``--compile auto`` are each a pure function of *facts*
(device type, CPU flags, GPU bf16 support, whether torch.compile builds kernels, a matmul probe) and the user's
request, so every branch is testable with made-up facts. ``detect()`` gathers this machine's facts; ``resolve()``
returns the choices with their reasons, which every run prints and records in ``run_info.json``.

What is measured is kept in one bounded, versioned cache, ``probes.json`` (``cached``, ``cache_update``), which
``gpt2lab env`` lists and ``--clear-cache`` removes: the CPU matmul probe's rates (fp32 and bf16, a fraction of a
second, once per CPU model, flags, torch version, threads and oneDNN ISA cap) and the inference probe's figures
(inference/probe.py). Work on a device is timed by one timer, ``timed``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import os
import platform
import shutil
import time
from dataclasses import dataclass
from typing import Any, Optional

from gpt2lab.system import env, formats
from gpt2lab.system.choices import COMPILE_CHOICES, DTYPE_CHOICES, NS_DTYPE_CHOICES
from gpt2lab.system.errors import ConfigError
from gpt2lab.system.files import read_json_object, write_json

# x86 /proc/cpuinfo flags of native bf16 arithmetic (AVX512_BF16 dot products, AMX tiles) and the aarch64 one
# (BF16 instructions, Armv8.6). Without one, oneDNN converts bf16 to fp32 around every multiply and a bf16 matmul
# runs 2-4x *slower* than fp32.
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
# The flags worth recording: the ones above and the vector width the fp32 kernels get.
NOTED_CPU_FLAGS = BF16_CPU_FLAGS + ("amx_tile", "avx512f", "avx512_vnni", "avx2", "fma", "asimd", "sve")
# bf16 must beat fp32 by this factor in the matmul probe before a CPU run switches to it: under autocast the
# non-matmul work stays fp32 and every forward adds casts of the weights, so a matmul that is only a little faster
# in bf16 does not make the step faster. Native-bf16 CPUs clear it by far (AVX512_BF16 ~3x, AMX more); emulating
# ones fall below 1.
BF16_MIN_SPEEDUP = 1.3
PROBE_N = 1024  # square matmul side: 2 GFLOP a call, big enough to reach the GEMM rate
PROBE_SECONDS = 0.2  # timed per dtype, after one untimed call


@dataclass(frozen=True)
class Probe:
    """Measured dense matmul rates (GFLOP/s) on the device."""

    fp32_gflops: float
    bf16_gflops: float

    @property
    def bf16_speedup(self) -> float:
        return self.bf16_gflops / self.fp32_gflops if self.fp32_gflops > 0 else 0.0


@dataclass(frozen=True)
class Facts:
    """Everything the choices depend on; ``detect()`` fills it for this machine."""

    device_type: str  # "cpu", "cuda" or "mps"
    device_name: str = ""  # CPU model or GPU name
    cpu_flags: tuple[str, ...] = ()  # the NOTED_CPU_FLAGS this CPU has
    cuda_bf16: bool = False  # torch.cuda.is_bf16_supported()
    can_compile: bool = True  # a kernel compiler for the device (triton / a C++ compiler)
    probe: Optional[Probe] = None  # CPU: matmul rates, None when not measured
    # inference (form.detect_facts): each decode kernel -> why it cannot run here, None where it runs ("packed":
    # oneDNN's packed linear, "bfloat16/packed" for bf16 weights, "int8", "gemv": gpt2lab's compiled GEMV,
    # "panels": its AVX512_BF16 routines); one not listed was not detected
    kernels: Optional[dict] = None
    timings: Optional[dict] = None  # candidate name -> inference.choice.Timing, or -> why it was dropped

    def cannot(self, kernel: str) -> Optional[str]:
        return (self.kernels or {}).get(kernel, "not detected")

    @property
    def native_bf16(self) -> bool:
        return self.cuda_bf16 if self.device_type == "cuda" else any(f in self.cpu_flags for f in BF16_CPU_FLAGS)


@dataclass(frozen=True)
class Choice:
    value: object
    reason: str
    warning: Optional[str] = None  # a choice that runs, but slower than it could


class ChoiceError(ConfigError):
    """A requested dtype/compile setting this device cannot run; the message says what to use."""


# -- the choices: pure functions of (facts, request) -------------------------------------
def _checked(name: str, requested: str, choices: tuple) -> str:
    if requested not in choices:
        raise ChoiceError(f"{name} {requested!r}: choose one of {', '.join(choices)}")
    return requested


def choose_dtype(requested: str, facts: Facts) -> Choice:
    """The autocast dtype: the user's if the device can do it, else the fastest correct one."""
    dev = facts.device_type
    if _checked("dtype", requested, DTYPE_CHOICES) == "float16" and dev == "cpu":
        raise ChoiceError(
            "--dtype float16 needs a GPU (fp16 training relies on a gradient scaler "
            "and CPU fp16 kernels are slow); use --dtype auto, bfloat16 or float32"
        )
    if requested == "bfloat16" and dev == "cuda" and not facts.cuda_bf16:
        raise ChoiceError(
            f"--dtype bfloat16: {facts.device_name or 'this GPU'} has no bf16; "
            "use --dtype auto (fp16 with a gradient scaler) or float32"
        )
    if requested != "auto":
        return Choice(requested, "asked for with --dtype", _slow_bf16(facts) if requested == "bfloat16" else None)
    return _auto_dtype(facts, "float16")


def choose_ns_dtype(requested: str, facts: Facts) -> Choice:
    """The dtype of Muon's Newton-Schulz iteration (pure matmuls): bf16 where a bf16 matmul is fast.

    torch.optim.Muon hard-codes bf16; on a CPU that emulates it (no AVX512_BF16/AMX) that runs
    the iteration ~50x slower than fp32 would, a step's dominant cost. The rule is the
    autocast one (``_auto_dtype``), with fp32 on a GPU without bf16.
    """
    if _checked("muon_ns_dtype", requested, NS_DTYPE_CHOICES) != "auto":
        return Choice(requested, "asked for with --muon-ns-dtype")
    return _auto_dtype(facts, "float32")


def _auto_dtype(facts: Facts, without_bf16: str) -> Choice:
    """bf16 on a GPU that has it (else ``without_bf16``: fp16 with a gradient scaler, or fp32), fp32 on MPS,
    and on a CPU bf16 where its probe measures a bf16 matmul >= BF16_MIN_SPEEDUP x fp32 (unprobed: where it
    has a native bf16 flag)."""
    gpu = facts.device_name or "this GPU"
    if facts.device_type == "cuda":
        if facts.cuda_bf16:
            return Choice("bfloat16", f"{gpu} has fast bf16 matmuls")
        scaler = ": fp16 with a gradient scaler" if without_bf16 == "float16" else ""
        return Choice(without_bf16, f"{gpu} has no bf16{scaler}")
    if facts.device_type == "mps":
        return Choice(
            "float32",
            "MPS: bf16/fp16 autocast and matmuls are not reliable across macOS and torch "
            "versions, so fp32 (ask for bfloat16 to measure it on yours)",
        )
    p = facts.probe
    if p is not None:
        rates = f"matmul probe: bf16 {p.bf16_gflops:.0f} vs fp32 {p.fp32_gflops:.0f} GFLOP/s"
        if p.bf16_speedup >= BF16_MIN_SPEEDUP:
            return Choice("bfloat16", f"bf16 is {p.bf16_speedup:.1f}x fp32 on this CPU ({rates})")
        return Choice("float32", f"bf16 is not faster on this CPU ({rates}; needs {BF16_MIN_SPEEDUP}x)")
    if facts.native_bf16:
        found = [f for f in BF16_CPU_FLAGS if f in facts.cpu_flags]
        return Choice("bfloat16", f"native bf16 on this CPU ({', '.join(found)}; not probed)")
    return Choice("float32", "no native bf16 on this CPU (no AVX512_BF16/AMX/BF16 flag; not probed)")


def _slow_bf16(facts: Facts) -> Optional[str]:
    """The warning of an asked-for bf16 on a CPU measured slower in it (unprobed: without native bf16), else None."""
    p = facts.probe
    if facts.device_type != "cpu" or (p is None and facts.native_bf16) or (p is not None and p.bf16_speedup >= 1.0):
        return None
    if p is None:
        return "--dtype bfloat16 on a CPU without native bf16 is usually slower than float32"
    return (
        f"--dtype bfloat16 is {1 / max(p.bf16_speedup, 1e-9):.1f}x slower than fp32 on this CPU (matmul probe: "
        f"bf16 {p.bf16_gflops:.0f} vs fp32 {p.fp32_gflops:.0f} GFLOP/s); --dtype auto would use float32"
    )


def choose_compile(requested: str, facts: Facts) -> Choice:
    """torch.compile on or off: the user's choice, else on where it pays."""
    if _checked("compile", requested, COMPILE_CHOICES) != "auto":
        if requested == "true" and not facts.can_compile:
            raise ChoiceError(
                f"--compile true: torch.compile cannot build kernels here ({_no_compiler(facts)}); use --compile false"
            )
        return Choice(requested == "true", f"asked for with --compile {requested}")
    if not facts.can_compile:
        return Choice(False, f"torch.compile unavailable ({_no_compiler(facts)})")
    if facts.device_type == "cuda":
        return Choice(True, "CUDA: fused kernels pay back the compile time within the first steps")
    if facts.device_type == "mps":
        return Choice(False, "MPS: torch.compile support is still experimental")
    return Choice(
        False,
        "CPU: compiled steps measured no faster than eager (the matmuls, run by the same oneDNN/MKL kernels "
        "either way, are the step), and compiling costs a minute; see docs/benchmarks.md",
    )


def _no_compiler(facts: Facts) -> str:
    return "no triton" if facts.device_type == "cuda" else "no C++ compiler on PATH"


# -- the facts of this machine ------------------------------------------------------------
@functools.lru_cache(maxsize=None)  # /proc/cpuinfo does not change while a process runs
def _cpuinfo(*keys: str) -> Optional[str]:
    """The value of the first line of /proc/cpuinfo (Linux) that starts with one of ``keys``; None elsewhere."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        return next((line.split(":", 1)[1].strip() for line in fh if line.startswith(keys)), None)
    return None


def cpu_flags() -> tuple[str, ...]:
    """The NOTED_CPU_FLAGS in /proc/cpuinfo (Linux); () elsewhere."""
    have = set((_cpuinfo("flags", "Features") or "").split())
    return tuple(f for f in NOTED_CPU_FLAGS if f in have)


def cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def can_compile(device_type: str) -> bool:
    if device_type == "cuda":
        return importlib.util.find_spec("triton") is not None
    if device_type == "mps":
        return True
    return any(shutil.which(c) for c in (env.cxx(), "g++", "c++", "clang++") if c)


def timed(fn, device="cpu", clock=time.perf_counter) -> tuple[float, Any]:
    """(seconds, result) of ``fn()``, ``device``'s queued work included (before it too)."""
    sync(device)
    t0 = clock()
    out = fn()
    sync(device)
    return clock() - t0, out


def measure_matmul(device, n: int = PROBE_N, seconds: float = PROBE_SECONDS) -> Probe:
    """fp32 and bf16 ``a @ b`` rates on ``device``, each timed for about ``seconds`` after one untimed call."""
    import torch

    def rate(dtype) -> float:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        timed(lambda: a @ b, device)  # the first call, untimed
        calls, spent = 0, 0.0
        while spent < seconds:
            spent += timed(lambda: a @ b, device)[0]
            calls += 1
        return 2 * n**3 * calls / spent / 1e9

    return Probe(fp32_gflops=round(rate(torch.float32), 1), bf16_gflops=round(rate(torch.bfloat16), 1))


# The buffer `measure_read_bandwidth` reads: 1 GiB, more than any CPU's last-level cache (the largest,
# AMD's 3D V-Cache parts, hold about 1.1 GiB across a whole socket, which a slice of cores does not
# see), so the figure is memory's, the one that bounds decoding: each token reads every weight.
READ_BYTES = 1 << 30


def measure_read_bandwidth(device, nbytes: int = READ_BYTES, repeats: int = 5, clock=time.perf_counter) -> float:
    """GB/s reading ``nbytes`` once (a sum over them, every thread torch uses), the best of ``repeats``
    after one warm-up: the memory bandwidth a decode step, which reads every weight, can reach."""
    import torch

    x = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    times = [timed(x.sum, device, clock)[0] for _ in range(repeats + 1)]  # the first pages the buffer in
    return round(x.numel() * 4 / min(times[1:]) / 1e9, 1)


def sync(device) -> None:
    """Wait for ``device``'s queued work (CUDA, MPS; a CPU's is done), before a clock is read."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


# -- the cache of what was measured: one bounded, versioned JSON file in gpt2lab's cache directory ----------
PROBE_FILE = "probes.json"
PROBE_ENTRIES = 32  # past this many entries the oldest written goes (a day of tests builds dozens of shapes)


def cache_path() -> str:
    return os.path.join(env.cache_dir(), PROBE_FILE)


def cached(where: Optional[str] = None) -> dict:
    """The cache's entries ({key: entry dict}); {} if absent, unreadable or of another format version."""
    data = read_json_object(where or cache_path()) or {}
    found = data.get("entries") if formats.is_current(data, formats.PROBES, key="version") else None
    return {k: v for k, v in found.items() if isinstance(v, dict)} if isinstance(found, dict) else {}


def cache_update(key: str, change, where: Optional[str] = None) -> bool:
    """Apply ``change(entry)`` (the entry dict, {} when new; ``change=None`` removes it) to entry ``key`` and
    write the file atomically, the oldest entries going past PROBE_ENTRIES; whether it was written (a
    read-only cache is no harm: what it lacks is measured again next time)."""
    where = where or cache_path()
    found = cached(where)
    if change is None and found.pop(key, None) is None:
        return False
    if change is not None:
        change(found.setdefault(key, {}))
        found[key].setdefault("written", time.time())
    keep = sorted(found, key=lambda k: found[k]["written"] if isinstance(found[k].get("written"), (int, float)) else 0)
    try:
        os.makedirs(os.path.dirname(where), exist_ok=True)
        write_json(where, {"version": formats.PROBES.version, "entries": {k: found[k] for k in keep[-PROBE_ENTRIES:]}})
    except OSError:
        return False
    return True


def cached_cpu_probe(where: Optional[str] = None) -> Optional[Probe]:
    """The CPU matmul probe, measured once per machine and kept in the cache (``where``: its file).

    ``GPT2LAB_PROBE=0`` turns it off (the choice then follows the CPU flags).
    """
    if env.probe_mode() == "0":
        return None
    key = f"cpu-matmul-{machine_key()}"
    with contextlib.suppress(KeyError, TypeError, AttributeError):
        return Probe(**cached(where)[key]["matmul_gflops"])
    probe = measure_matmul("cpu")
    cache_update(key, lambda e: e.update(device="cpu", matmul_gflops=dataclasses.asdict(probe)), where)
    return probe


def machine_key() -> str:
    """What a probe's answer depends on: the CPU, its flags, torch, threads and the kernels' ISA caps."""
    import torch

    caps = [env.isa_caps().get(v, "") for v in env.ISA_CAPS]
    parts = [cpu_name(), ",".join(cpu_flags()), torch.__version__, str(torch.get_num_threads()), *caps]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def detect(device, probe: bool = True) -> Facts:
    """The facts of ``device`` on this machine (the CPU probe from the cache when it can)."""
    import torch

    dev = torch.device(device)
    kind = dev.type if dev.type in ("cuda", "mps") else "cpu"
    name = torch.cuda.get_device_name(dev) if kind == "cuda" else "Apple MPS" if kind == "mps" else cpu_name()
    matmul = cached_cpu_probe() if probe and kind == "cpu" else None
    bf16 = kind == "cuda" and torch.cuda.is_bf16_supported()
    return Facts(kind, name, cpu_flags(), cuda_bf16=bf16, can_compile=can_compile(kind), probe=matmul)


@dataclass(frozen=True)
class Resolved:
    """The choices made for a run, with the facts behind them."""

    dtype: Choice
    compile: Choice
    facts: Facts
    ns_dtype: Optional[Choice] = None  # Muon's Newton-Schulz dtype (None: no Muon in this run)

    def summary(self) -> str:
        """One console line: what was chosen and why."""
        return (
            f"dtype {self.dtype.value} ({self.dtype.reason}); "
            f"compile {'on' if self.compile.value else 'off'} ({self.compile.reason})"
            + (f"; Muon Newton-Schulz in {self.ns_dtype.value} ({self.ns_dtype.reason})" if self.ns_dtype else "")
        )

    def record(self) -> dict:
        """The run_info.json entry."""
        f = self.facts
        out = {
            "dtype": self.dtype.value,
            "dtype_reason": self.dtype.reason,
            "compile": self.compile.value,
            "compile_reason": self.compile.reason,
            "warnings": [c.warning for c in (self.dtype, self.compile) if c.warning],
            "device_type": f.device_type,
            "device_name": f.device_name,
            "cpu_flags": list(f.cpu_flags),
            "native_bf16": f.native_bf16,
            "matmul_probe_gflops": dataclasses.asdict(f.probe) if f.probe else None,
        }
        if self.ns_dtype:
            out.update(muon_ns_dtype=self.ns_dtype.value, muon_ns_dtype_reason=self.ns_dtype.reason)
        return out


def resolve(
    device, dtype="auto", compile="false", facts: Optional[Facts] = None, ns_dtype: Optional[str] = None
) -> Resolved:
    """Decide dtype and compile (and Muon's Newton-Schulz dtype, unless ``ns_dtype`` is None: no
    Muon) for ``device``; the CPU probe runs only when an answer needs it."""
    dtype, compile = str(dtype), str(compile).lower()
    if facts is None:
        needs_probe = dtype in ("auto", "bfloat16") or ns_dtype == "auto"
        facts = detect(device, probe=needs_probe)
    ns = choose_ns_dtype(ns_dtype, facts) if ns_dtype is not None else None
    return Resolved(choose_dtype(dtype, facts), choose_compile(compile, facts), facts, ns)


# -- how waiting CPU threads wait: decided as a command starts, by what the machine is doing -------------
# PyTorch's threads and gpt2lab's compiled kernels share one OpenMP runtime (the libgomp torch loads), which
# reads its wait policy once, when torch is imported. By default a thread whose share of a parallel region is
# done spins a while before it sleeps: on an idle machine the next region starts at once (a decode step is
# hundreds of them), on a busy one each spinning thread holds a core that another process is waiting for
# (docs/benchmarks.md, "Beside other work"). The threads' count is left as it is: fp32 products round
# otherwise on another count, and a seeded text must not depend on the machine's load.


@dataclass(frozen=True)
class Load:
    """What the machine is doing as a command starts (``machine_load``)."""

    cores: int  # the CPUs this process may run on
    threads: int  # the threads of its parallel regions (OMP_NUM_THREADS, else one a core)
    others: int  # cores other processes kept busy as it started (``machine_load``)
    asked: str = ""  # the user's own wait settings ("OMP_WAIT_POLICY=active"), which stand


def choose_wait(load: Load) -> Choice:
    """OMP_WAIT_POLICY for this process (None: OpenMP's default, spinning a while): PASSIVE where its threads
    and the others' outnumber the cores, so that a thread with nothing to do gives its core up at once."""
    if load.asked:
        return Choice(None, f"as set ({load.asked})")
    if load.others + load.threads > load.cores:
        return Choice(
            "PASSIVE",
            f"threads sleep while they wait: {load.others} core{'s' * (load.others > 1)} busy with other work, "
            f"{load.threads} of ours on {load.cores} cores",
        )
    return Choice(None, f"threads spin while they wait: nothing else running on {load.cores} cores")


def _cpu_times(stat: str = "/proc/stat") -> Optional[tuple[int, int, int]]:
    """The machine's CPU time so far from /proc/stat: (busy, total) in clock ticks over all its CPUs, and their
    count (busy: all but idle and waiting for I/O)."""
    try:
        with open(stat) as fh:
            lines = fh.read().splitlines()
        ticks = [int(v) for v in next(ln for ln in lines if ln.startswith("cpu ")).split()[1:9]]
    except (OSError, ValueError, StopIteration):
        return None
    count = sum(ln.startswith("cpu") and ln[3:4].isdigit() for ln in lines)
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks), max(1, count)


def machine_load(window_s: float = 0.025, looks: int = 4, times=_cpu_times, settings=None) -> Load:
    """This machine's ``Load`` now: the cores other processes kept busy over each of ``looks`` windows of
    ``window_s`` (the machine's busy time less this process's own), the least of them, rounded: a process
    that ran for a moment (a kernel thread, a shell, the next command of a pipe starting) is not a busy
    machine, one computing throughout is a core; ``settings``: the OpenMP variables (``env.openmp()``)."""
    settings = env.openmp() if settings is None else settings
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = settings.get("OMP_NUM_THREADS", "").split(",")[0]
    seen, before, own = [], times(), time.process_time()
    for _ in range(looks):
        time.sleep(window_s)
        after, mine = times(), time.process_time()
        if before and after and after[1] > before[1]:
            busy = (after[0] - before[0]) / (after[1] - before[1]) * after[2]  # cores busy on average
            seen.append(busy - ((mine - own) / window_s if window_s > 0 else 0.0))
        before, own = after, mine
    others = max(0, round(min(seen))) if seen else 0
    asked = ", ".join(f"{v}={settings[v]}" for v in env.WAIT_SETTINGS if settings.get(v))
    return Load(cores, int(threads) if threads.isdigit() and int(threads) > 0 else cores, others, asked)


WAIT: Optional[Choice] = None  # this process's wait policy, where a command decided it (set_wait_policy)


def set_wait_policy() -> None:
    """Decide how this process's threads wait (``choose_wait``) and set it for OpenMP to read: before torch
    is imported (the command line does, first), else nothing is decided (OpenMP has read its settings)."""
    global WAIT
    import sys

    if "torch" in sys.modules:
        return
    WAIT = choose_wait(machine_load())
    if WAIT.value:
        env.put_wait_policy(WAIT.value)
