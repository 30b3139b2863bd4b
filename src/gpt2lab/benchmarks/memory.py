"""gpt2lab bench memory: predicted per-rank memory of a training step next to the measured
peak, the micro-batch a card fits, and the largest micro-batch that trains.

Three modes:
- ``--micro-batch B``: the planner's prediction (gpt2lab.distributed.memplan, term by term) for the
  size, strategy, world size, dtype and activation checkpointing given, and, unless
  ``--measure false``, ``--steps`` training steps as ``gpt2lab train`` runs them (autocast,
  the chunked loss, fused AdamW, ``--accum`` micro-steps, clipping) on random tokens with
  the peak measured: ``torch.cuda.max_memory_allocated`` on a GPU, the process's peak
  RSS on CPU. Under torchrun every rank measures itself; rank 0 prints all of them.
- ``--plan GPU_GB``: the largest micro-batch per strategy and activation checkpointing
  whose predicted peak fits a card of GPU_GB GiB (an "80 GB" H100 or A100 holds 80 GiB).
- otherwise the search: at doubling micro-batch sizes until one runs out of memory, then a
  bisection between the last that fit and the first that did not, each try printed with
  its peak memory and the prediction. On CPU it runs only the tries it is given
  (``--max-batch``).

The model is a GPT-2 size (``--size``) or a training preset's architecture (``--preset``, e.g.
wiki-cpu-fast's modern block: rotary, RMSNorm, QK-norm, ReLU^2, untied head), planned and
built as ``gpt2lab train`` builds it. The optimizer is AdamW either way, and so is the
prediction beside it, whatever the preset trains with (the run plan of a Muon run predicts
Muon's smaller state: memplan.optimizer_state_bytes).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
from typing import Optional

import torch

from gpt2lab.benchmarks import timed
from gpt2lab.distributed import memplan
from gpt2lab.distributed.dist import pick_device
from gpt2lab.model.config import GPT2_VOCAB_SIZE, PADDED_VOCAB_SIZE
from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.model.loss import choose_loss
from gpt2lab.system import env
from gpt2lab.system.choices import finite_float
from gpt2lab.system.errors import UsageError
from gpt2lab.train.optim import make_optimizer
from gpt2lab.train.trainer import accumulate_gradients

MiB = 2**20
TINY = dict(n_layer=2, n_head=2, n_embd=64)  # for CPU measurements and tests


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default=None, help="GPT-2 size: 124M (default), 350M, 774M, 1558M, or tiny (2 x 64)")
    p.add_argument(
        "--preset",
        default=None,
        metavar="NAME",
        help="instead of --size: a training preset's architecture (its modern-block switches, "
        "block_size, vocab) and seq_len; the other settings are this command's flags",
    )
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 1024, or the preset's)")
    p.add_argument("--max-batch", type=int, default=1024, help="search mode: stop searching here")
    p.add_argument("--compile", default="false", choices=["true", "false"])
    p.add_argument("--device", default=None)
    p.add_argument("--strategy", default="ddp", help=f"one of {', '.join(memplan.STRATEGIES)}")
    p.add_argument(
        "--world-size", type=int, default=None, help="ranks to predict for (default: torchrun's WORLD_SIZE, else 1)"
    )
    p.add_argument("--micro-batch", type=int, default=None, help="predict (and measure) this micro-batch")
    p.add_argument("--dtype", default="bfloat16", help=f"one of {', '.join(memplan.DTYPE_BYTES)}")
    p.add_argument("--activation-checkpointing", default="false", choices=["true", "false"])
    p.add_argument(
        "--accum",
        type=int,
        default=2,
        help="micro-steps per step (more than 1 keeps gradients alive through the forward)",
    )
    p.add_argument(
        "--steps", type=int, default=2, help="measured training steps (at least 2: the first creates AdamW's moments)"
    )
    p.add_argument(
        "--keep-cpu-memory",
        default="true",
        choices=["true", "false"],
        help="CPU: glibc keeps freed memory in the process, as the trainer's keep_cpu_memory",
    )
    p.add_argument(
        "--tensor-peak",
        default="false",
        choices=["true", "false"],
        help="CPU: also record every allocation (torch.profiler) and report the peak of live "
        "tensor bytes, the planner's tensor terms (slower; its RSS is not the trainer's)",
    )
    p.add_argument("--measure", default="true", choices=["true", "false"], help="false: the prediction only")
    p.add_argument(
        "--plan",
        type=finite_float,
        default=None,
        metavar="GPU_GB",
        help="largest micro-batch per strategy that fits a card of this many GiB",
    )


def model_config(size: str, seq_len: int) -> GPTConfig:
    """The size as gpt2lab trains it: vocab padded to 50304, block_size = seq_len."""
    if seq_len < 1:
        raise UsageError(f"--seq-len must be positive, got {seq_len}")
    extra = TINY if size.lower() == "tiny" else {}
    try:
        if extra:
            return GPTConfig(
                vocab_size=PADDED_VOCAB_SIZE, token_vocab_size=GPT2_VOCAB_SIZE, block_size=seq_len, **extra
            )
        return GPTConfig.preset(
            size, vocab_size=PADDED_VOCAB_SIZE, token_vocab_size=GPT2_VOCAB_SIZE, block_size=seq_len
        )
    except ValueError as e:
        raise UsageError(f"--size {size}: {e}") from None


def resolve_model(args: argparse.Namespace) -> GPTConfig:
    """The architecture asked for: a GPT-2 size (block_size = seq_len), or with ``--preset`` the
    preset's model as ``gpt2lab train`` builds it. Sets ``args.size`` (the label printed) and
    ``args.seq_len`` when they were left out."""
    if args.preset is None:
        args.size = args.size or "124M"
        args.seq_len = 1024 if args.seq_len is None else args.seq_len
        return model_config(args.size, args.seq_len)
    if args.size is not None:
        raise UsageError("--size and --preset both given; pass one (a preset brings its own architecture)")
    from gpt2lab.train.settings import load_preset

    preset = load_preset(args.preset)
    args.seq_len = preset.batch.seq_len if args.seq_len is None else args.seq_len
    if not 1 <= args.seq_len <= preset.model.block_size:
        raise UsageError(
            f"--seq-len {args.seq_len}: preset {args.preset} takes 1 to its block_size {preset.model.block_size}"
        )
    args.size = args.preset
    return preset.model


def run(args: argparse.Namespace) -> Optional[dict]:
    cfg = resolve_model(args)
    memplan.check(args.strategy, args.world_size or 1, args.micro_batch or 1, args.dtype, args.accum, "cpu")
    if args.steps < 2:  # the first step creates AdamW's moments; the planned peak is a later step's
        raise UsageError(f"--steps must be at least 2, got {args.steps}")
    if args.plan is not None:
        return budget_table(cfg, args)
    if args.micro_batch is not None:
        return predict_and_measure(cfg, args)
    return search(cfg, args)


def budget_table(cfg: GPTConfig, args: argparse.Namespace) -> dict:
    world = args.world_size or 1
    # for a run as `gpt2lab train` makes it on a GPU: compiled (memplan.largest_micro_batches' default)
    rows = memplan.largest_micro_batches(
        int(args.plan * 2**30), cfg, world_size=world, seq_len=args.seq_len, dtype=args.dtype
    )
    for r in rows:
        r["predicted_gib"] = round(r.pop("predicted_bytes") / 2**30, 2)
    return {
        "size": args.size,
        "gpu_gib": args.plan,
        "world_size": world,
        "seq_len": args.seq_len,
        "dtype": args.dtype,
        "plans": rows,
    }


def _prediction(cfg: GPTConfig, args: argparse.Namespace, world: int, device: str, B: int) -> memplan.Prediction:
    return memplan.predict(
        cfg,
        strategy=args.strategy,
        world_size=world,
        micro_batch=B,
        seq_len=args.seq_len,
        dtype=args.dtype,
        activation_checkpointing=args.activation_checkpointing == "true",
        accum=args.accum,
        device=device,
    )  # measured eagerly (_build): the chunked loss


def tensor_bytes(pred: memplan.Prediction) -> int:
    """The prediction without what is not a tensor (the runtime; on CPU the heap's slack)."""
    return pred.total - pred.terms["runtime"] - pred.terms.get("allocator", 0)


def predict_and_measure(cfg: GPTConfig, args: argparse.Namespace) -> Optional[dict]:
    env_world = env.launch().world_size
    measure = args.measure == "true"
    if measure and args.world_size not in (None, env_world):
        raise UsageError(
            f"--world-size {args.world_size}: a measured run has torchrun's {env_world} ranks; "
            f"launch with torchrun --nproc_per_node {args.world_size}, or add --measure false"
        )
    world = args.world_size or env_world
    device = "cuda" if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda") else "cpu"
    pred = _prediction(cfg, args, world, device, args.micro_batch)
    out = {
        "size": args.size,
        "modern": cfg.modern(),
        "params": memplan.param_counts(cfg)["total"],
        "strategy": args.strategy,
        "world_size": world,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "dtype": args.dtype,
        "activation_checkpointing": args.activation_checkpointing == "true",
        "accum": args.accum,
        "device": device,
        "predicted_mib": pred.to_dict(MiB),
    }
    if not measure:
        return out
    peaks, rank = measure_peaks(cfg, args)
    if rank != 0:
        return None
    if device == "cuda":  # max_memory_allocated counts tensors only, not the runtime term
        predicted = tensor_bytes(pred) / MiB
        out["measured"] = "torch.cuda.max_memory_allocated (tensors; the runtime term excluded)"
    else:
        predicted = pred.total / MiB
        out["measured"] = "peak RSS of each rank's process (getrusage ru_maxrss)"
    out["measured_peak_mib"] = [round(p[0] / MiB, 1) for p in peaks]
    if device == "cpu":  # next to the planner's runtime term
        out["measured_rss_before_model_mib"] = [round(p[1] / MiB, 1) for p in peaks]
    out["measured_over_predicted"] = round(max(p[0] for p in peaks) / MiB / predicted, 3)
    out["seconds_per_step"] = round(max(p[3] for p in peaks), 3)  # median after the first; the slowest rank
    if peaks[0][2] is not None:  # the tensor model alone, without the allocator and the runtime
        tensors = max(p[2] for p in peaks)
        out["measured_tensor_peak_mib"] = round(tensors / MiB, 1)
        out["tensors_over_predicted"] = round(tensors / tensor_bytes(pred), 3)
    return out


def measure_peaks(cfg: GPTConfig, args: argparse.Namespace) -> tuple[list[tuple], int]:
    """(peak bytes over ``args.steps`` training steps, resident bytes before the model was
    built, peak tensor bytes or None, median seconds per step after the first) of each rank,
    and this rank."""
    from gpt2lab.distributed.dist import cleanup, init_distributed

    info = init_distributed(args.device)
    try:
        # the model, DDP's reducer and FSDP's state are gone when _measure returns: freed
        # after the process group is destroyed, DDP's reducer can wait forever on gloo
        peaks = [_measure(cfg, args, info)]
        if info.distributed:
            import torch.distributed as dist

            mine, peaks = peaks[0], [None] * info.world_size
            dist.all_gather_object(peaks, mine)
        return peaks, info.rank
    finally:
        cleanup()


def _measure(cfg: GPTConfig, args: argparse.Namespace, info) -> tuple:
    from gpt2lab.train.trainer import keep_freed_memory

    baseline = _rss_bytes()
    if info.device.type == "cpu" and args.keep_cpu_memory == "true":
        keep_freed_memory()  # as the trainer does on CPU (keep_cpu_memory, on by default)
    model, raw, opt = _build(cfg, args, info)
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(info.device)
    x = torch.randint(0, cfg.real_vocab_size, (args.micro_batch, args.seq_len))
    times = []

    def steps() -> None:
        for _ in range(args.steps):
            seconds, _ = timed(lambda: step(model, raw, opt, x, args, info.device), info.device)
            times.append(seconds)

    tensors = None
    if args.tensor_peak == "true" and info.device.type == "cpu":
        local = (p.to_local() if hasattr(p, "to_local") else p for p in raw.parameters())  # FSDP: shards
        tensors = _tensor_peak(steps) + sum(t.untyped_storage().nbytes() for t in local)
    else:
        steps()
    return _peak_bytes(info.device), baseline, tensors, statistics.median(times[1:])


def step(
    model: torch.nn.Module, raw: GPT, opt, x: torch.Tensor, args: argparse.Namespace, device: torch.device
) -> None:
    """One optimizer step as the trainer takes it (micro-steps, clipping, AdamW)."""
    from gpt2lab.distributed import parallel

    accumulate_gradients(model, lambda: (x, x), args.accum, device, args.dtype)
    parallel.clip_grad_norm(raw, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _build(cfg: GPTConfig, args: argparse.Namespace, info) -> tuple[torch.nn.Module, GPT, torch.optim.Optimizer]:
    """The model as the trainer wraps it (gpt2lab.distributed.parallel), the GPT itself, and AdamW on its
    (for FSDP: sharded) parameters."""
    from gpt2lab.distributed import parallel

    torch.manual_seed(0)
    raw = GPT(cfg).to(info.device)
    raw.activation_checkpointing = args.activation_checkpointing == "true"
    model, _ = parallel.wrap(
        raw, args.strategy, distributed=info.distributed, device=info.device, dtype=args.dtype, compile=False
    )
    opt = make_optimizer(raw, lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, device=info.device)
    return model, raw, opt


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
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _rss_bytes() -> int:
    """This process's resident size now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def try_batch(model: GPT, opt, B: int, T: int, device: torch.device, compiled, dtype: str = "bfloat16") -> dict:
    """One step at micro-batch B: {"B", "fits", "peak_gib"}."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        x = torch.randint(0, 50257, (B, T), device=device)
        accumulate_gradients(compiled, lambda: (x, x), 1, device, dtype)  # the trainer's micro-step
        opt.step()
        fits = True
    except torch.OutOfMemoryError:
        fits = False
    finally:
        opt.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"B": B, "fits": fits, "peak_gib": round(peak, 2) if peak is not None else None}


def search(cfg: GPTConfig, args: argparse.Namespace) -> dict:
    device = pick_device(args.device)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    compile, ac = args.compile == "true", args.activation_checkpointing == "true"
    model.set_loss(choose_loss(device.type, compile))  # the trainer's loss
    model.activation_checkpointing = ac
    opt = make_optimizer(model, lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, device=device)
    compiled = torch.compile(model) if compile else model
    kind = "cuda" if device.type == "cuda" else "cpu"

    def attempt(B: int) -> dict:
        rec = try_batch(model, opt, B, args.seq_len, device, compiled, args.dtype)
        pred = memplan.predict(
            cfg,
            micro_batch=B,
            seq_len=args.seq_len,
            dtype=args.dtype,
            accum=1,
            device=kind,
            activation_checkpointing=ac,
            compiled=compile,
        )
        rec["predicted_gib"] = round(tensor_bytes(pred) / 2**30, 2)  # tensors only, like the peak
        print(json.dumps(rec), flush=True)
        return rec

    tries, good, bad, B = [], 0, None, 1
    while B <= args.max_batch:  # doubling
        rec = attempt(B)
        tries.append(rec)
        if not rec["fits"]:
            bad = B
            break
        good, B = B, 2 * B
    while bad is not None and bad - good > 1:  # bisection
        mid = (good + bad) // 2
        rec = attempt(mid)
        tries.append(rec)
        good, bad = (mid, bad) if rec["fits"] else (good, mid)
    return {
        "size": args.size,
        "seq_len": args.seq_len,
        "device": str(device),
        "params": model.num_params(),
        "compile": compile,
        "activation_checkpointing": ac,
        "largest_micro_batch": good or None,
        "searched_up_to": args.max_batch,
        "tries": tries,
    }
