"""Typed errors and the exit codes ``cli.main`` turns them into.

Library code raises one of these with a message that names the file or value and says
what to do; ``gpt2lab.cli.main`` prints that message as one line and exits with the
class's code (``--debug`` or ``GPT2LAB_DEBUG=1`` shows the traceback instead). Each
class also derives from the builtin the code raised before it existed (ValueError,
OSError, RuntimeError), so ``except ValueError`` around library calls keeps working.
"""

from __future__ import annotations

import errno
import signal

# The documented exit codes (README "Exit codes", `gpt2lab --help`).
EXIT_OK = 0
EXIT_ERROR = 1  # bad input: a data, source or model file that cannot be used
EXIT_USAGE = 2  # a flag or config value that cannot work (argparse uses 2 as well)
EXIT_CHECKPOINT = 3  # a checkpoint that is damaged or does not fit the model
EXIT_DISK_FULL = 4  # no space left on the device (nothing half-written is left behind)
EXIT_DIVERGED = 5  # training stopped: the loss kept being non-finite or spiking
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130: Ctrl-C; a training run saved a checkpoint first
EXIT_PREEMPTED = 128 + signal.SIGTERM  # 143: SIGTERM; checkpoint saved, resume with --resume auto

EXIT_CODES = {
    EXIT_OK: "done",
    EXIT_ERROR: "bad input (a data, source or model file) or another error",
    EXIT_USAGE: "bad flag or config value",
    EXIT_CHECKPOINT: "checkpoint damaged or does not fit the model",
    EXIT_DISK_FULL: "disk full (free space, then rerun; training: --resume auto)",
    EXIT_DIVERGED: "training diverged (non-finite or spiking loss); resume from the last good checkpoint",
    EXIT_INTERRUPTED: "interrupted by Ctrl-C (training saved a checkpoint when it could)",
    EXIT_PREEMPTED: "stopped by SIGTERM after saving a checkpoint: resume with --resume auto",
}


class GPT2LabError(Exception):
    """Base of gpt2lab's errors; ``exit_code`` is what ``gpt2lab`` exits with."""

    exit_code = EXIT_ERROR


class UsageError(GPT2LabError, ValueError):
    """A setting that cannot work (ConfigError is one)."""

    exit_code = EXIT_USAGE


class ConfigError(UsageError):
    """A setting (or a combination of settings) that cannot work; the message says what to change."""


class DataError(GPT2LabError, ValueError):
    """Input data (a shard, a text source, a model directory) that cannot be used as it is."""


class CheckpointError(GPT2LabError, ValueError):
    """A checkpoint that is damaged (checksum, truncated file) or does not fit the model."""

    exit_code = EXIT_CHECKPOINT


class DiskFullError(GPT2LabError, OSError):
    """A write ran out of space; whatever it had half-written was removed."""

    exit_code = EXIT_DISK_FULL


class RunDiverged(GPT2LabError, RuntimeError):
    """Training cannot continue (repeated non-finite or spiking losses)."""

    exit_code = EXIT_DIVERGED


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# Writers that report a short write without its errno: torch.save's zip writer says
# "unexpected pos" (or "file write failed"), safetensors says StorageFull / os error 28.
_DISK_FULL_TEXT = ("No space left", "Disk quota exceeded", "StorageFull", "os error 28")  # OSError, safetensors
_DISK_FULL_TEXT += ("unexpected pos", "file write failed")  # torch.save


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a full disk or quota."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS or any(t in str(exc) for t in _DISK_FULL_TEXT):
            return True  # the errno, or the text of a RuntimeError or SafetensorError
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def disk_full(path: str, what_next: str = "free some space and run the command again") -> DiskFullError:
    """The one-line error for a write of ``path`` that ran out of space."""
    import os
    import shutil

    where = path
    while where and not os.path.exists(where):
        where = os.path.dirname(where)
    try:
        free = f"{shutil.disk_usage(where or '.').free / 2**20:.0f} MiB free"
    except OSError:
        free = "free space unknown"
    err = DiskFullError(f"disk full while writing {path} ({free}); nothing half-written was kept; {what_next}")
    err.errno = errno.ENOSPC
    return err
