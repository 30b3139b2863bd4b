"""gpt2lab bench memory: the run plan's per-rank memory of a training step (gpt2lab.train.memplan) next
to the peak measured on the trainer's own step, the micro-batch a card fits, and the largest that trains.

Three modes, each for a run as ``gpt2lab train`` makes it (its plan, its Trainer), on random tokens
(shards written to a temporary folder, removed after):
- ``--micro-batch B``: the plan's prediction, term by term, and, unless ``--measure false``,
  ``--steps`` steps of ``Trainer.train_step`` with the peak measured: ``torch.cuda.max_memory_allocated``
  on a GPU, the process's peak RSS on a CPU (``--tensor-peak true``: also the profiler's peak of live
  tensor bytes). Under torchrun every rank measures itself; rank 0 prints all of them.
- ``--plan GPU_GB``: the largest micro-batch per strategy and activation checkpointing whose predicted
  peak fits a card of GPU_GB GiB (an "80 GB" H100 or A100 holds 80 GiB).
- otherwise the search: at doubling micro-batch sizes until one runs out of memory, then a bisection
  between the last that fit and the first that did not, each try printed with its peak and the
  prediction. On CPU it runs only the tries it is given (``--max-batch``).

The model is a GPT-2 size (``--size``: the gpt2-124m recipe at that size) or a training preset
(``--preset``: its architecture, optimizer and seq_len); this command's flags set the rest.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
from typing import Optional

import torch

from gpt2lab.benchmarks import peak_rss_bytes, rss_bytes, timed
from gpt2lab.benchmarks.loader import synthetic_shards
from gpt2lab.distributed.dist import DistInfo, cleanup, from_every_rank, init_distributed, pick_device
from gpt2lab.model.config import GPTConfig
from gpt2lab.system import env
from gpt2lab.system.choices import DTYPES, STRATEGIES, finite_float
from gpt2lab.system.errors import ConfigError, UsageError
from gpt2lab.train import memplan
from gpt2lab.train.config import TrainConfig
from gpt2lab.train.settings import load_preset

MiB = 2**20
TINY = dict(n_layer=2, n_head=2, n_embd=64)  # for CPU measurements and tests


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", help="GPT-2 size: 124M (default), 350M, 774M, 1558M, or tiny (2 x 64)")
    p.add_argument("--preset", metavar="NAME", help="instead of --size: a training preset (architecture, optimizer)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 1024, or the preset's)")
    p.add_argument("--max-batch", type=int, default=1024, help="search mode: stop searching here")
    p.add_argument("--compile", default="false", choices=["true", "false"])
    p.add_argument("--device")
    p.add_argument("--strategy", default="ddp", help=f"one of {', '.join(STRATEGIES)}")
    p.add_argument("--world-size", type=int, help="ranks to predict for (default: torchrun's WORLD_SIZE, else 1)")
    p.add_argument("--micro-batch", type=int, help="predict (and measure) this micro-batch")
    p.add_argument("--dtype", default="bfloat16", help=f"one of {', '.join(DTYPES)}")
    p.add_argument("--activation-checkpointing", default="false", choices=["true", "false"])
    p.add_argument("--accum", type=int, default=2, help="micro-steps per step (more than 1 keeps gradients alive)")
    p.add_argument("--steps", type=int, default=2, help="measured training steps (at least 2)")
    p.add_argument("--keep-cpu-memory", default="true", choices=["true", "false"], help="as train's flag (CPU)")
    p.add_argument("--tensor-peak", default="false", choices=["true", "false"], help="CPU: also live tensors' peak")
    p.add_argument("--measure", default="true", choices=["true", "false"], help="false: the prediction only")
    p.add_argument("--plan", type=finite_float, metavar="GPU_GB", help="the largest micro-batches fitting GPU_GB GiB")


def run_config(args: argparse.Namespace, micro_batch: int, accum: int, world: int) -> TrainConfig:
    """The run asked for, as ``gpt2lab train`` would take it: a GPT-2 size (block_size = seq_len) on the
    gpt2-124m recipe, or ``--preset``'s run; sets ``args.size`` (the label printed) and ``args.seq_len``."""
    if args.preset is not None and args.size is not None:
        raise UsageError("--size and --preset both given; pass one (a preset brings its own architecture)")
    arch = {}
    try:
        if args.preset is None:
            args.size, args.seq_len = args.size or "124M", args.seq_len or 1024
            shape = TINY if args.size.lower() == "tiny" else {k: getattr(GPTConfig.preset(args.size), k) for k in TINY}
            arch = {**shape, "block_size": args.seq_len}
        cfg = load_preset(args.preset or "gpt2-124m", **arch, **({"seq_len": args.seq_len} if args.seq_len else {}))
        args.size, args.seq_len = args.size or args.preset, args.seq_len or cfg.batch.seq_len
        return cfg.with_values(
            seq_len=args.seq_len,
            micro_batch_size=micro_batch,
            total_batch_tokens=micro_batch * args.seq_len * world * accum,
            **{k: getattr(args, k) for k in ("dtype", "compile", "strategy")},
            **{k: getattr(args, k) == "true" for k in ("activation_checkpointing", "keep_cpu_memory")},
            device=str(args.device or "auto"),
            max_steps=args.steps,
            init_from=None,
            progress=False,
            **dict.fromkeys(("eval_interval", "hellaswag_interval", "sample_interval", "ckpt_interval"), 0),
        )
    except ConfigError as e:
        raise UsageError(f"--{'preset' if args.preset else 'size'} {args.size}: {e}") from None


def run(args: argparse.Namespace) -> Optional[dict]:
    memplan.check_values(args.strategy, args.world_size or 1, args.micro_batch or 1, args.dtype, args.accum, "cpu")
    if args.steps < 2:  # the first step creates AdamW's moments; the planned peak is a later step's
        raise UsageError(f"--steps must be at least 2, got {args.steps}")
    if args.plan is not None:
        world = args.world_size or 1
        cfg = run_config(args, 1, 1, world)
        rows = memplan.largest_micro_batches(int(args.plan * 2**30), cfg, world_size=world, dtype=args.dtype)
        for r in rows:
            r["predicted_gib"] = round(r.pop("predicted_bytes") / 2**30, 2)
        plan = {"gpu_gib": args.plan, "world_size": world, "seq_len": args.seq_len, "dtype": args.dtype}
        return {"size": args.size, **plan, "plans": rows}
    if args.micro_batch is not None:
        return predict_and_measure(args)
    return search(args)


def tensor_mib(predicted: dict) -> float:
    """A prediction (MiB by term) without what is not a tensor (the runtime; on CPU the heap's slack)."""
    return predicted["total"] - predicted["runtime"] - predicted.get("allocator", 0)


def predict_and_measure(args: argparse.Namespace) -> Optional[dict]:
    env_world = env.launch().world_size
    measure = args.measure == "true"
    if measure and args.world_size not in (None, env_world):
        raise UsageError(
            f"--world-size {args.world_size}: a measured run has torchrun's {env_world} ranks; "
            f"launch with torchrun --nproc_per_node {args.world_size}, or add --measure false"
        )
    world = args.world_size or env_world
    device = "cuda" if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda") else "cpu"
    cfg = run_config(args, args.micro_batch, args.accum, world)
    pred = memplan.predict(
        cfg, strategy=args.strategy, world_size=world, dtype=args.dtype, accum=args.accum, device=device
    )
    out = {
        "size": args.size,
        "modern": cfg.model.modern(),
        "params": memplan.params(cfg),
        **{k: getattr(args, k) for k in ("strategy", "micro_batch", "seq_len", "dtype", "accum")},
        "world_size": world,
        "optimizer": cfg.optim.optimizer,
        "activation_checkpointing": cfg.parallel.activation_checkpointing,
        "device": device,
        "predicted_mib": pred.to_dict(MiB),
    }
    if not measure:
        return out
    info = init_distributed(args.device)
    try:
        # the trainer, DDP's reducer and FSDP's state are gone when _measure returns: freed
        # after the process group is destroyed, DDP's reducer can wait forever on gloo
        with tempfile.TemporaryDirectory() as tmp:
            peaks = from_every_rank(_measure(cfg, args, info, tmp))
    finally:
        cleanup()
    if info.rank != 0:
        return None
    predicted = pred.total / MiB
    out["measured"] = "peak RSS of each rank's process (getrusage ru_maxrss)"
    if device == "cuda":  # max_memory_allocated counts tensors only, not the runtime term
        predicted, out["measured"] = tensor_mib(out["predicted_mib"]), "torch.cuda.max_memory_allocated (tensors)"
    out["measured_peak_mib"] = [round(p[0] / MiB, 1) for p in peaks]
    if device == "cpu":  # next to the planner's runtime term
        out["measured_rss_before_model_mib"] = [round(p[1] / MiB, 1) for p in peaks]
    out["measured_over_predicted"] = round(max(p[0] for p in peaks) / MiB / predicted, 3)
    out["seconds_per_step"] = round(max(p[3] for p in peaks), 3)  # median after the first; the slowest rank
    if peaks[0][2] is not None:  # the tensors alone, without the allocator and the runtime
        tensors = max(p[2] for p in peaks) / MiB
        out["measured_tensor_peak_mib"] = round(tensors, 1)
        out["tensors_over_predicted"] = round(tensors / tensor_mib(out["predicted_mib"]), 3)
    return out


def _measure(cfg: TrainConfig, args: argparse.Namespace, info, tmp: str) -> tuple:
    """(peak bytes over the steps, resident bytes before the trainer was built, the profiler's peak of
    live tensors or None, median seconds per step after the first) of this rank: ``cfg``'s Trainer on
    random token shards written into ``tmp`` (enough for its steps)."""
    from gpt2lab.train.trainer import Trainer

    baseline, b = rss_bytes(), cfg.batch
    tokens = (cfg.optim.max_steps + 1) * b.total_batch_tokens + info.world_size * b.micro_batch_size * b.seq_len + 1
    if info.rank == 0:
        synthetic_shards(tmp, max(tokens, 4096))
    if info.distributed:
        torch.distributed.barrier()
    trainer = Trainer.from_config(cfg.with_values(data=tmp, out=tmp + "/run"), info)
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(info.device)
    times: list[float] = []

    def steps() -> None:
        times.extend(timed(trainer.train_step, info.device)[0] for _ in range(args.steps))

    tensors = None
    if args.tensor_peak == "true" and info.device.type == "cpu":
        local = (p.to_local() if hasattr(p, "to_local") else p for p in trainer.raw.parameters())  # FSDP: shards
        tensors = _tensor_peak(steps) + sum(t.untyped_storage().nbytes() for t in local)
    else:
        steps()
    return _peak_bytes(info.device), baseline, tensors, statistics.median(times[1:])


def _tensor_peak(fn) -> int:
    """Peak bytes of tensors allocated while ``fn`` runs (net of those it freed), from the
    profiler's record of every CPU allocation and free."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type().name == "CPU"
    )
    return max(itertools.accumulate((nbytes for _, nbytes in events), initial=0))  # the most live at once


def _peak_bytes(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()


def search(args: argparse.Namespace) -> dict:
    device = pick_device(args.device)
    info, compiled = DistInfo(device=device), args.compile == "true"
    kind = "cuda" if device.type == "cuda" else "cpu"

    tries: list[dict] = []  # doubling until one does not fit, then a bisection

    def fits(B: int) -> bool:
        cfg = run_config(args, B, 1, 1)
        pred = memplan.predict(cfg, dtype=args.dtype, accum=1, device=kind, compiled=compiled)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        ok = True
        try:
            with tempfile.TemporaryDirectory() as tmp:
                _measure(cfg, args, info, tmp)  # the trainer is gone when it returns, or raises
        except torch.OutOfMemoryError:
            ok = False
        peak = round(_peak_bytes(device) / 2**30, 2) if device.type == "cuda" else None
        predicted = round(tensor_mib(pred.to_dict(MiB)) / 1024, 2)  # tensors only, like the peak
        rec = {"B": B, "fits": ok, "peak_gib": peak, "predicted_gib": predicted}
        print(json.dumps(rec), flush=True)
        tries.append(rec)
        return ok

    good = memplan.largest_fitting(fits, args.max_batch)
    return {
        "size": args.size,
        "seq_len": args.seq_len,
        "device": str(device),
        "params": memplan.params(run_config(args, 1, 1, 1)),
        "compile": compiled,
        "activation_checkpointing": args.activation_checkpointing == "true",
        "largest_micro_batch": good or None,
        "searched_up_to": args.max_batch,
        "tries": tries,
    }
