"""Subcommands of the ``gpt2lab`` CLI (see cli.py)."""

import argparse
import os
import shlex
import shutil
import sys


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with every flag's default, ``(default: X)``, except where there is none to show
    (a required flag, or a default of None that the help text explains)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.required or action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


DEVICE_HELP = "cpu, cuda, cuda:N, mps or auto (cuda > mps > cpu)"


def add_model_flags(p: argparse.ArgumentParser, **model) -> None:
    """``--model`` (``model``: its default or ``required``, ...), ``--device`` and the inference flags."""
    from gpt2lab.inference.flags import add_inference_flags

    model.setdefault("help", "HF name (gpt2 ... gpt2-xl), HF model dir, run dir or checkpoint dir")
    p.add_argument("--model", **model)
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    add_inference_flags(p)


def program() -> str:
    """How the user calls gpt2lab, as advice that runs: plain ``gpt2lab`` when that is on PATH, else
    the script beside this Python (``.venv/bin/gpt2lab`` after ``make demo``), else ``python -m
    gpt2lab``; under torchrun, torchrun with this node's process count (several nodes: the user's
    own rendezvous flags, which no process sees)."""
    from gpt2lab.system import env

    launch = env.launch()
    if launch.elastic:
        local, nodes = launch.local_world_size or 1, launch.nodes
        if nodes == 1:
            return f"torchrun --standalone --nproc_per_node={local} -m gpt2lab"
        return f"torchrun --nnodes={nodes} --nproc_per_node={local} <your --rdzv flags> -m gpt2lab"
    script = os.path.join(os.path.dirname(sys.executable), "gpt2lab")
    on_path = shutil.which("gpt2lab")
    if on_path and os.path.exists(script) and os.path.samefile(on_path, script):
        return "gpt2lab"
    if os.path.exists(script):
        rel = os.path.relpath(script)
        return shlex.quote(rel if not rel.startswith("..") else script)
    return f"{shlex.quote(sys.executable)} -m gpt2lab"


def note_live(command: str, paths) -> None:
    """A note on stderr for each of ``paths`` (a run directory or one of its checkpoints,
    ``RUN/checkpoints/step_N``) that a live run is writing: it is read, nothing written."""
    from gpt2lab.system import rundir

    for path in filter(os.path.isdir, paths):
        for run in (path, os.path.dirname(os.path.dirname(os.path.abspath(path)))):
            if (who := rundir.holder(run)) is not None:
                said = f"{run} is a live run ({rundir.describe(who)}): reading what it has written so far"
                print(f"{command}: note: {said}", file=sys.stderr, flush=True)
                break
