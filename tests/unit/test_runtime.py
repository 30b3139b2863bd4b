"""dtype/compile ``auto``: every branch of the choice, from made-up capability facts."""

from __future__ import annotations

import json

import pytest
import torch

from gpt2lab.system import env, runtime
from gpt2lab.system.runtime import ChoiceError, Facts, Probe, choose_compile, choose_dtype

# Rates like the two CPUs of docs/benchmarks.md: an Intel Xeon without AVX512_BF16 (bf16 emulated)
# and an AMD Zen 4 with it.
EMULATED = Probe(fp32_gflops=202.0, bf16_gflops=52.0)
NATIVE = Probe(fp32_gflops=130.0, bf16_gflops=400.0)
CPU_NO_BF16 = Facts("cpu", "Xeon", ("avx512f", "avx512_vnni"), probe=EMULATED)
CPU_BF16 = Facts("cpu", "EPYC", ("avx512_bf16", "avx512f"), probe=NATIVE)
A100 = Facts("cuda", "NVIDIA A100", cuda_bf16=True)
V100 = Facts("cuda", "Tesla V100", cuda_bf16=False)
MPS = Facts("mps", "Apple MPS")


@pytest.mark.parametrize(
    "facts, expected",
    [
        (CPU_NO_BF16, "float32"),
        (CPU_BF16, "bfloat16"),
        (A100, "bfloat16"),
        (V100, "float16"),
        (MPS, "float32"),
        # no probe: the CPU flags decide
        (Facts("cpu", cpu_flags=("avx2",)), "float32"),
        (Facts("cpu", cpu_flags=("amx_bf16", "avx512_bf16")), "bfloat16"),
        (Facts("cpu", cpu_flags=("asimd", "bf16")), "bfloat16"),
    ],
)
def test_auto_dtype(facts, expected):
    choice = choose_dtype("auto", facts)
    assert choice.value == expected and choice.reason and choice.warning is None


def test_probe_outweighs_the_flags():
    # AVX512_BF16 present but oneDNN capped below it (ONEDNN_MAX_CPU_ISA): the probe says slow
    capped = Facts("cpu", cpu_flags=("avx512_bf16",), probe=Probe(150.0, 30.0))
    assert choose_dtype("auto", capped).value == "float32"
    # no flag, but bf16 measured well ahead (a CPU this table does not know)
    assert choose_dtype("auto", Facts("cpu", probe=Probe(100.0, 250.0))).value == "bfloat16"


def test_bf16_needs_a_clear_margin_on_cpu():
    just_below = Probe(100.0, 100.0 * runtime.BF16_MIN_SPEEDUP - 1)
    at = Probe(100.0, 100.0 * runtime.BF16_MIN_SPEEDUP)
    assert choose_dtype("auto", Facts("cpu", probe=just_below)).value == "float32"
    assert choose_dtype("auto", Facts("cpu", probe=at)).value == "bfloat16"


@pytest.mark.parametrize("facts", [CPU_NO_BF16, CPU_BF16, A100, V100, MPS])
def test_explicit_float32_always_wins(facts):
    assert choose_dtype("float32", facts).value == "float32"


def test_impossible_dtypes_are_errors_that_say_what_to_use():
    with pytest.raises(ChoiceError, match="float16 needs a GPU.*auto"):
        choose_dtype("float16", CPU_BF16)
    with pytest.raises(ChoiceError, match="V100 has no bf16.*fp16"):
        choose_dtype("bfloat16", V100)
    with pytest.raises(ChoiceError, match="choose one of"):
        choose_dtype("int8", A100)


def test_slow_bf16_on_cpu_runs_with_a_warning():
    choice = choose_dtype("bfloat16", CPU_NO_BF16)
    assert choice.value == "bfloat16"
    assert "3.9x slower" in choice.warning and "float32" in choice.warning  # 202 / 52
    assert choose_dtype("bfloat16", CPU_BF16).warning is None
    assert "without native bf16" in choose_dtype("bfloat16", Facts("cpu", cpu_flags=("avx2",))).warning


@pytest.mark.parametrize(
    "facts, expected", [(A100, True), (V100, True), (CPU_BF16, False), (CPU_NO_BF16, False), (MPS, False)]
)
def test_auto_compile(facts, expected):
    assert choose_compile("auto", facts).value is expected


def test_compile_without_a_compiler():
    no_triton = Facts("cuda", "NVIDIA A100", cuda_bf16=True, can_compile=False)
    assert choose_compile("auto", no_triton).value is False
    assert "triton" in choose_compile("auto", no_triton).reason
    with pytest.raises(ChoiceError, match="C\\+\\+ compiler.*--compile false"):
        choose_compile("true", Facts("cpu", can_compile=False))
    assert choose_compile("true", CPU_NO_BF16).value is True
    assert choose_compile("false", A100).value is False


def test_probe_is_measured_once_and_cached_per_machine(tmp_path, monkeypatch):
    calls = []

    def fake_measure(device, *a, **k):
        calls.append(device)
        return Probe(100.0, 300.0)

    monkeypatch.setattr(runtime, "measure_matmul", fake_measure)
    monkeypatch.setenv("GPT2LAB_PROBE", "1")
    where = str(tmp_path / runtime.PROBE_FILE)
    assert runtime.cached_cpu_probe(where) == Probe(100.0, 300.0)
    assert runtime.cached_cpu_probe(where) == Probe(100.0, 300.0)
    assert len(calls) == 1
    [f] = tmp_path.iterdir()
    [entry] = json.loads(f.read_text())["entries"].values()  # the one cache of measurements, beside the decode probe's
    assert entry["matmul_gflops"] == {"fp32_gflops": 100.0, "bf16_gflops": 300.0}
    from gpt2lab.commands.env import entry_lines  # as gpt2lab env lists it

    assert entry_lines(entry)[0].startswith("CPU matmul probe: fp32 100.0, bf16 300.0 GFLOP/s, measured 20")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # another ISA cap is another machine
    runtime.cached_cpu_probe(where)
    assert len(calls) == 2
    monkeypatch.setenv("GPT2LAB_PROBE", "0")
    assert runtime.cached_cpu_probe(where) is None


def test_real_probe_measures_both_dtypes():
    p = runtime.measure_matmul(torch.device("cpu"), n=128, seconds=0.02)
    assert p.fp32_gflops > 0 and p.bf16_gflops > 0


def test_resolve_records_what_and_why():
    res = runtime.resolve("cpu", "auto", "auto", facts=CPU_NO_BF16)
    rec = res.record()
    assert rec["dtype"] == "float32" and rec["compile"] is False
    assert rec["matmul_probe_gflops"] == {"fp32_gflops": 202.0, "bf16_gflops": 52.0}
    assert rec["native_bf16"] is False and rec["cpu_flags"] == ["avx512f", "avx512_vnni"]
    assert "dtype float32" in res.summary() and "compile off" in res.summary()


def test_read_bandwidth_is_bytes_over_the_best_timed_read():
    """The first read (paging the buffer in) is not timed; of the rest the fastest counts."""
    durations = iter([9e-3, 5e-4, 2.5e-4, 4e-4])  # warm-up, then three timed reads
    clock = {"t": 0.0, "start": True}

    def fake_clock():
        if not clock["start"]:
            clock["t"] += next(durations)
        clock["start"] = not clock["start"]
        return clock["t"]

    nbytes = 1 << 20
    assert (
        runtime.measure_read_bandwidth("cpu", nbytes=nbytes, repeats=3, clock=fake_clock)
        == round(nbytes / 2.5e-4 / 1e9, 1)
        == 4.2
    )


# -- how waiting threads wait: by what the machine is doing as a command starts


@pytest.mark.parametrize(
    "load, policy",
    [
        (runtime.Load(cores=2, threads=2, others=0), None),  # idle: spinning starts each region at once
        (runtime.Load(cores=2, threads=2, others=1), "PASSIVE"),  # one busy neighbour: 3 threads, 2 cores
        (runtime.Load(cores=2, threads=1, others=1), None),  # OMP_NUM_THREADS=1 beside it: room for both
        (runtime.Load(cores=64, threads=64, others=1), "PASSIVE"),
        (runtime.Load(cores=64, threads=8, others=40), None),
        (runtime.Load(cores=2, threads=2, others=3, asked="OMP_WAIT_POLICY=active"), None),  # the user's stands
    ],
)
def test_threads_sleep_while_they_wait_where_ours_and_the_others_outnumber_the_cores(load, policy):
    choice = runtime.choose_wait(load)
    assert choice.value == policy
    said = {None: "threads spin while they wait", "PASSIVE": "threads sleep while they wait"}[policy]
    assert choice.reason.startswith("as set (OMP_WAIT_POLICY=active)" if load.asked else said)


def test_the_machines_load_is_the_cores_other_work_kept_busy_throughout_a_few_short_windows(tmp_path):
    """/proc/stat's busy ticks over each window, scaled to the machine's CPUs, less this process's own; the least
    window, rounded: a process that ran for a moment is not a busy machine, one computing throughout is a core;
    OMP_NUM_THREADS is the threads of ours, the user's wait settings are named."""
    stat = tmp_path / "stat"  # user nice system idle iowait irq softirq steal; two CPUs
    stat.write_text("cpu  10 0 5 80 5 0 0 0 0 0\ncpu0 5 0 3 40 2 0 0 0\ncpu1 5 0 2 40 3 0 0 0\nprocs_running 3\n")
    assert runtime._cpu_times(str(stat)) == (15, 100, 2) and runtime._cpu_times(str(tmp_path / "none")) is None

    def looks(*busy):  # the busy ticks of each window of 100 ticks, two CPUs
        seq, b = [(0, 0, 2)], 0
        for i, n in enumerate(busy):
            b += n
            seq.append((b, 100 * (i + 1), 2))
        return iter(seq).__next__

    one = {"OMP_NUM_THREADS": "1"}
    # a neighbour computing on one of two cores throughout: half the ticks busy in every window -> one core
    load = runtime.machine_load(0.0, 3, times=looks(50, 52, 48), settings=one)
    assert (load.threads, load.others, load.asked) == (1, 1, "")
    # a process starting beside (a pipe's next command) busy in the first window only -> no core
    assert runtime.machine_load(0.0, 3, times=looks(60, 3, 2), settings=one).others == 0
    # both cores busy throughout -> two
    assert runtime.machine_load(0.0, 3, times=looks(100, 100, 98), settings=one).others == 2
    env = {"GOMP_SPINCOUNT": "1000", "OMP_NUM_THREADS": "junk"}
    load = runtime.machine_load(0.0, 3, times=lambda: None, settings=env)  # no /proc: nothing seen busy
    assert (load.others, load.asked) == (0, "GOMP_SPINCOUNT=1000") and load.threads == load.cores >= 1


def test_this_processs_own_work_over_the_window_is_not_another_s(monkeypatch):
    """Both cores busy over the window, one of them by this process (a core's worth of its CPU time): one other."""
    cpu = iter([1.0, 1.05])  # this process's CPU seconds at the window's start and end: 0.05 s over 0.05 s
    monkeypatch.setattr(runtime.time, "process_time", lambda: next(cpu))
    monkeypatch.setattr(runtime.time, "sleep", lambda s: None)
    seq = iter([(0, 0, 2), (100, 100, 2)])
    assert runtime.machine_load(0.05, 1, times=lambda: next(seq), settings={}).others == 1


def test_the_command_line_sets_the_policy_before_openmp_reads_it():
    """A fresh `gpt2lab` process on a busy machine (its load faked): libgomp, as torch loads it, reports the
    policy the load decided (OMP_DISPLAY_ENV: GOMP_SPINCOUNT 0 is PASSIVE; OpenMP's default spins 300000
    times), and so does the inference record of the process."""
    import os
    import subprocess
    import sys

    code = (
        "from gpt2lab.system import runtime\n"
        "runtime.machine_load = lambda: runtime.Load(2, 2, 3)\n"
        "from gpt2lab import cli\n"
        "try:\n    cli.main(['env', '--help'])\nexcept SystemExit:\n    pass\n"
        "import torch  # libgomp loads: it reads the policy now\n"
        "from gpt2lab.inference.choice import InferenceRequest, choose\nfrom gpt2lab.system.runtime import Facts\n"
        "print(choose(InferenceRequest(), Facts('cpu')).record()['threads_wait'])\n"
    )
    clean = {k: v for k, v in os.environ.items() if k not in env.WAIT_SETTINGS}
    p = subprocess.run(
        [sys.executable, "-c", code], env={**clean, "OMP_DISPLAY_ENV": "verbose"}, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    assert "GOMP_SPINCOUNT = '0'" in p.stderr
    assert (
        p.stdout.splitlines()[-1] == "threads sleep while they wait: 3 cores busy with other work, 2 of ours on 2 cores"
    )
