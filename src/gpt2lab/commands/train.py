"""gpt2lab train: run a preset with any field overridden; single process or under torchrun."""
from __future__ import annotations

import argparse

from gpt2lab.train.config import (ConfigError, TrainConfig, add_config_flags, config_file_values,
                                  overrides_from_args, preset_names, preset_values)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model from a preset (torchrun for several processes)",
        description="Train from a preset; every config field is a flag. Several processes: "
                    "torchrun --standalone --nproc_per_node=N -m gpt2lab train ...",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    start = p.add_mutually_exclusive_group(required=True)
    start.add_argument("--preset", metavar="NAME", help=f"one of: {', '.join(preset_names())}")
    start.add_argument("--config", metavar="FILE.toml",
                       help='your own settings: a TOML file with the presets\' keys; base = "PRESET" starts '
                            "from a packaged preset")
    p.add_argument("--resume", default=None, metavar="auto|PATH",
                   help="auto: continue from the newest intact checkpoint in --out (fresh start if none); "
                        "PATH: a run directory or a checkpoint directory")
    add_config_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Errors (ConfigError, bad data, damaged checkpoint, full disk) reach cli.main as one line."""
    from gpt2lab.distributed.dist import cleanup, init_distributed
    from gpt2lab.train.trainer import Stopped, train

    cfg = _config(args)
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


def _config(args: argparse.Namespace) -> TrainConfig:
    """The preset with the flags; with --init-from, the architecture of its source."""
    overrides = overrides_from_args(args)
    if "init_from" in overrides and args.resume:
        raise ConfigError(f"--init-from {overrides['init_from']} and --resume {args.resume} both given: "
                          "--init-from starts a new run from those weights (fresh optimizer, step 0), "
                          "--resume continues a run where it stopped; pass one of them")
    values = {**(preset_values(args.preset) if args.preset else config_file_values(args.config)), **overrides}
    source = f"preset {args.preset!r}" if args.preset else args.config
    if values.get("init_from") or args.resume:
        from gpt2lab.train.init_from import ARCH_FIELDS, source_arch, started_from

        explicit = {k: v for k, v in overrides.items() if k in ARCH_FIELDS}
        # resuming a run that began from other weights: the architecture is its checkpoint's
        out = values.get("out", TrainConfig.__dataclass_fields__["out"].default)
        resume = started_from(out if args.resume == "auto" else args.resume) if args.resume else None
        if resume:
            values.update(init_from=resume[1], **source_arch(resume[0], explicit, flag="--resume"))
        elif values.get("init_from"):
            values.update(source_arch(values["init_from"], explicit))
    return TrainConfig.from_dict(values, source=f"{source} with overrides")
