"""gpt2lab train: run a preset with any field overridden; single process or under torchrun."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from gpt2lab.commands import program
from gpt2lab.system.rundir import resume_command
from gpt2lab.train.config import merge_config
from gpt2lab.train.settings import (
    add_config_flags,
    config_file_values,
    overrides_from_args,
    preset_names,
    preset_values,
    prompt_written_for,
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model from a preset (torchrun for several processes)",
        description="Train from a preset; every config field is a flag. Several processes: "
        "torchrun --standalone --nproc_per_node=N -m gpt2lab train ...",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    start = p.add_mutually_exclusive_group(required=True)
    start.add_argument("--preset", metavar="NAME", help=f"one of: {', '.join(preset_names())}")
    start.add_argument("--config", metavar="FILE.toml", help='TOML of preset keys; base = "PRESET" starts from one')
    start.add_argument("--list-presets", action="store_true", help="list presets: size, recipe, steps, time, export")
    # auto: the newest intact checkpoint in --out (a fresh start if none)
    p.add_argument("--resume", metavar="auto|PATH", help="auto (--out's newest intact checkpoint) or a run/checkpoint")
    # GPT2LAB_FAKE_FACTS=FILE.json plans for a machine described in FILE (docs/training.md)
    p.add_argument("--dry-run", action="store_true", help="print the run plan and exit, training and writing nothing")
    add_config_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Errors (ConfigError, bad data, damaged checkpoint, full disk) reach cli.main as one line."""
    if args.list_presets:
        from gpt2lab.train.presets import listing

        print("\n".join(listing()))
        return 0
    from gpt2lab.distributed.dist import DistInfo, cleanup, init_distributed
    from gpt2lab.system import env
    from gpt2lab.train.run import train
    from gpt2lab.train.trainer import Stopped

    request = request_from(args)
    device = str(request.get("device"))
    faked = args.dry_run and env.fake_facts()  # a plan for another machine: none of this one's devices
    info = DistInfo() if faked else init_distributed(None if device == "auto" else device)
    try:
        last = train(request, info, dry_run=args.dry_run)
    except Stopped as e:  # saved; the exit code tells "resume me" from "done", the line how to go on
        if info.is_main:
            print(f"gpt2lab train: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    finally:
        cleanup()
    if info.is_main and not args.dry_run:  # the last lines: the run, its checkpoint, its plot, the report's command
        out, plot = request.out, os.path.join(request.out, "plot.png")
        lines = [f"run dir: {out}", last and f"last checkpoint: {last}", os.path.isfile(plot) and f"plot: {plot}"]
        print(*(line for line in lines if line), f"report: gpt2lab report {shlex.quote(out)}", sep="\n", flush=True)
    return 0


def request_from(args: argparse.Namespace):
    """The preset with the flags over it, as the run plan's input (train.plan decides the rest)."""
    from gpt2lab.train.init_from import ARCH_FIELDS
    from gpt2lab.train.plan import Request

    overrides = overrides_from_args(args)  # nested: {"optim": {"max_lr": ...}, ...}
    source = f"{f'preset {args.preset!r}' if args.preset else args.config} with overrides"
    values = merge_config(
        preset_values(args.preset) if args.preset else config_file_values(args.config), overrides, source=source
    )
    explicit = {k: v for k, v in overrides.get("model", {}).items() if k in ARCH_FIELDS or k == "vocab_size"}
    # --resume with --init-from: continues the run that began from those weights (train.gather.same_source)
    words = getattr(args, "argv", None) or ["train"]  # as typed (cli.main keeps it); the resume advice
    given = "sample_prompt" in overrides.get("eval", {})  # a prompt for this run; else the settings' (for their data)
    prompt_for = None if given else prompt_written_for(args.preset, None if args.preset else args.config)
    return Request(
        values, explicit, args.resume, source=source, command=resume_command(words, program()), prompt_for=prompt_for
    )
