"""gpt2lab train: run a preset with any field overridden; single process or under torchrun."""
from __future__ import annotations

import argparse

from gpt2lab.config import add_config_flags, load_preset, overrides_from_args, preset_names


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model from a preset (torchrun for several processes)",
        description="Train from a preset; every config field is a flag. Several processes: "
                    "torchrun --standalone --nproc_per_node=N -m gpt2lab train ...",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", required=True, metavar="NAME", help=f"one of: {', '.join(preset_names())}")
    p.add_argument("--resume", default=None, metavar="auto|PATH",
                   help="auto: continue from the newest intact checkpoint in --out (fresh start if none); "
                        "PATH: a run directory or a checkpoint directory")
    add_config_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Errors (ConfigError, bad data, damaged checkpoint, full disk) reach cli.main as one line."""
    from gpt2lab.dist import cleanup, init_distributed
    from gpt2lab.train import Stopped, train

    cfg = load_preset(args.preset, **overrides_from_args(args))
    info = init_distributed(None if cfg.device == "auto" else cfg.device)
    try:
        cfg.grad_accum_steps(info.world_size)  # fails early, naming the numbers to change
        last = train(cfg, info, args.resume)
    except Stopped as e:  # saved and said so; the exit code tells "resume me" from "done"
        return e.exit_code
    finally:
        cleanup()
    if info.is_main:
        print(f"run dir: {cfg.out}" + (f"\nlast checkpoint: {last}" if last else ""), flush=True)
    return 0
