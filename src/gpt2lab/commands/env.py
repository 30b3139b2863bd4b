"""gpt2lab env: what gpt2lab sees on this machine, for bug reports (like torch.utils.collect_env).

Versions and the code's git commit (as a run records them), the device ``auto`` picks, how the CPU
threads wait (by the machine's load as a command starts), the CPU's capability flags, fp32 and bf16
matmul rates and the memory read bandwidth measured afresh (about two seconds), whether torch.compile
can build kernels, whether a CPU hold's weights go on huge pages, what ``--dtype auto`` and
``--compile auto`` would choose and why, which optional extras are installed, and what the inference
probe has cached (the file, and per model shape: the device, when measured, what each workload chose,
every candidate's figures or why it was dropped, and why figures measured on a busy machine were not
kept). ``--clear-cache`` removes that file only (the CPU's cached matmul rates with it), so the next
``sample``, ``serve`` or ``eval`` measures again.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os

from gpt2lab.system import runtime
from gpt2lab.system.rundir import local_time

# The optional extras' packages (pyproject.toml), by what they enable.
OPTIONAL_PACKAGES = ("datasets", "pyarrow", "matplotlib", "tensorboard", "transformers", "lm_eval", "peft")
OPTIONAL_PACKAGES += ("fastapi", "uvicorn", "openai", "wandb")


def add_parser(sub) -> None:
    from gpt2lab.commands import DEVICE_HELP

    p = sub.add_parser("env", help="print what gpt2lab sees: versions, device, bf16, matmul GFLOP/s, auto choices")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    p.add_argument(
        "--clear-cache",
        action="store_true",
        help="remove gpt2lab's probe cache (probes.json in $GPT2LAB_CACHE or "
        "~/.cache/gpt2lab) and nothing else, so that the next sample, serve or eval measures again; "
        "prints what it removed",
    )
    p.set_defaults(func=run)


def collect(device_name: str = "auto") -> dict:
    import torch

    from gpt2lab import __version__
    from gpt2lab.distributed.dist import pick_device
    from gpt2lab.inference import pages
    from gpt2lab.inference.kernels import gemv_error, panels_run
    from gpt2lab.observe.metrics import run_info
    from gpt2lab.system import env as sysenv

    device = pick_device(device_name)
    facts = runtime.detect(device, probe=False)
    probe = runtime.measure_matmul(device)  # afresh, on the device itself (the run's probe is CPU-only)
    if device.type == "cpu":
        facts = dataclasses.replace(facts, probe=probe)
    choices = runtime.resolve(device, "auto", "auto", facts=facts, ns_dtype="auto")
    thp = pages.page_facts()
    return {
        "gpt2lab": __version__,
        # the code, library versions and hardware as a run records them (its run_info.json)
        **{k: v for k, v in run_info(device, 1).items() if k not in ("command", "world_size")},
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "mps_available": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()),
        "device_name": facts.device_name,
        # how waiting threads wait, decided as a command starts by what the machine is doing (system/runtime.py)
        "threads_wait": (runtime.WAIT or runtime.choose_wait(runtime.machine_load())).reason,
        "cpu_flags": list(facts.cpu_flags),
        "native_bf16": facts.native_bf16,
        "onednn_max_cpu_isa": sysenv.isa_caps().get("ONEDNN_MAX_CPU_ISA"),
        "matmul_fp32_gflops": probe.fp32_gflops,
        "matmul_bf16_gflops": probe.bf16_gflops,
        "matmul_size": runtime.PROBE_N,
        "read_gb_per_s": runtime.measure_read_bandwidth(device),  # what bounds decoding: each token reads every weight
        # where a CPU hold puts its weights (inference/pages.py): Linux's transparent huge pages, or why not
        "held_weight_pages": thp.why_not() or f"huge pages of {thp.size // 2**20} MiB",
        "compile_available": facts.can_compile,
        # gpt2lab's compiled GEMV (bf16, int8; setup.py builds it where a C compiler is): why not, or "runs here"
        # with its routines (AVX512_BF16 dot products for inputs rounded to bf16 where the CPU has them: panels_run)
        "compiled_gemv": gemv_error(torch.device("cpu"))
        or "runs here (AVX2" + (", AVX512_BF16 dot products)" if panels_run(2) else ")"),
        "auto_dtype": choices.dtype.value,
        "auto_dtype_reason": choices.dtype.reason,
        "auto_compile": choices.compile.value,
        "auto_compile_reason": choices.compile.reason,
        "auto_muon_ns_dtype": choices.ns_dtype.value,
        "auto_muon_ns_dtype_reason": choices.ns_dtype.reason,
        "extras": {name: _version(name) for name in OPTIONAL_PACKAGES},
        "probe_cache": {"path": runtime.cache_path(), "entries": runtime.cached()},  # as stored (system/runtime.py)
    }


def entry_lines(entry: dict) -> list[str]:
    """A cache entry as lines for ``gpt2lab env``: the CPU's matmul rates; or the model's shape and device,
    when measured, what each workload chose, each candidate's figures (or why it was dropped), and why
    figures measured on a busy machine were not kept."""
    from gpt2lab.inference.probe import Timing, cached_timings

    if isinstance(rates := entry.get("matmul_gflops"), dict):
        fp32, bf16 = rates.get("fp32_gflops"), rates.get("bf16_gflops")
        return [f"CPU matmul probe: fp32 {fp32}, bf16 {bf16} GFLOP/s, measured {_stamp(entry)}"]
    shape = entry.get("model") or {}
    lines = [
        f"{shape.get('n_layer', '?')} layers, {shape.get('n_head', '?')} heads, {shape.get('n_embd', '?')} wide, "
        f"vocabulary {shape.get('vocab_size', '?')}, block {shape.get('block_size', '?')} on "
        f"{entry.get('device', '?')}, measured {_stamp(entry)}"
    ]
    if choices := entry.get("choices"):
        lines.append("chose: " + ", ".join(f"{w} {c}" for w, c in sorted(choices.items())))
    for name, t in (cached_timings(entry) or {}).items():
        if isinstance(t, Timing):
            tiles = f", its tiles up to {t.tile_rows} rows" if t.tile_rows else ""
            lines.append(f"{name}: prefill {t.prefill:.3g} ms, one-row step {t.step1:.3g} ms{tiles}")
        else:
            lines.append(f"{name}: {t}")
    for rows in sorted(entry.get("rows") or {}):
        figs = cached_timings(entry, int(rows)) or {}
        text = ", ".join(f"{n} {v:.3g} ms" if isinstance(v, float) else f"{n} {v}" for n, v in figs.items())
        lines.append(f"{rows}-row step (serve): {text}")
    for what, note in sorted((entry.get("not_kept") or {}).items()):  # a machine too busy to measure on
        why = note.get("why") if isinstance(note, dict) else None
        why = "; ".join(map(str, why)) if isinstance(why, list) else "?"
        lines.append(f"not kept ({what} figures, {_stamp(note)}: the machine was busy): {why}")
    return lines


def _stamp(found) -> str:
    return local_time(found.get("written") if isinstance(found, dict) else None)


def clear_cache() -> int:
    """``--clear-cache``: remove the probe cache file (nothing else), saying what was removed (or that there was
    none)."""
    n, where = len(runtime.cached()), runtime.cache_path()
    try:
        os.remove(where)
        print(f"gpt2lab env: removed {where} ({_entries(n)} of measured figures)")
    except FileNotFoundError:
        print(f"gpt2lab env: no probe cache at {where}; nothing removed")
    return 0


def _entries(n: int) -> str:
    return f"{n} {'entry' if n == 1 else 'entries'}"


def _version(package: str):
    try:
        return importlib.metadata.version(package.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return None


def run(args: argparse.Namespace) -> int:
    if args.clear_cache:
        return clear_cache()
    info = collect(args.device)
    if args.json:
        print(json.dumps(info))
        return 0
    cache = info.pop("probe_cache")  # the last field: its entries follow, one line each and theirs indented
    info["extras"] = ", ".join(f"{k} {v}" if v else f"{k} (not installed)" for k, v in info["extras"].items())
    info["probe_cache"] = f"{cache['path']} ({_entries(len(cache['entries']))})"
    for key, value in info.items():
        print(f"{key + ':':<22} {', '.join(value) or 'none' if isinstance(value, list) else value}")
    for key, entry in cache["entries"].items():
        first, *rest = entry_lines(entry)
        print("\n".join([f"  {key}: {first}", *(f"    {line}" for line in rest)]))
    return 0
