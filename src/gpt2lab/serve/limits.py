"""What a serving worker takes on, and what the server takes from a connection before it is a
request: each limit declared once, with its ``gpt2lab serve`` flag's help (``add_flags`` builds the
flags from it); torch-free, so the CLI's flags can show the defaults."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Optional

from gpt2lab.system.choices import finite_float
from gpt2lab.system.errors import UsageError


def _flag(default, help: str, **argument):
    """A field that is a serve flag: its help, and what argparse takes beyond the field's name and type."""
    return field(default=default, metadata={"help": help, **argument})


def flag_name(f) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def host_list(text: str) -> tuple[str, ...]:
    """--allowed-hosts: comma-separated names, without ports."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n != "*" and ("/" in n or " " in n or (n.count(":") == 1 and not n.startswith("[")))]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"expected host names separated by commas, without ports or schemes (example.org,10.0.0.5), got {text!r}"
        )
    return names


class _Checked:
    def __post_init__(self) -> None:
        """Every number positive (a zero --max-batch would never admit a row); the error names the flag."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not value > 0:
                must = "positive" if isinstance(value, float) else "at least 1"
                raise ValueError(f"{flag_name(f)} {value}: must be {must}")


@dataclass(frozen=True)
class Limits(_Checked):
    """What one worker takes on (the ``gpt2lab serve`` flags of the same names)."""

    max_batch: int = _flag(16, "rows (prompt x sample streams) generated together per model")
    max_queue: int = _flag(64, "requests waiting for a row; past it the server answers 429 at once")
    max_tokens: int = _flag(1024, "the largest max_tokens a request may ask for")
    timeout_s: float = _flag(
        600.0, "seconds a request may wait and run; past it, a 504 error", flag="--timeout", metavar="TIMEOUT"
    )
    prefill_chunk: int = _flag(
        256, "prompt tokens run per step while other requests decode (long prompts take several steps)"
    )


# A request's headers are a few hundred bytes (uvicorn takes at most 16 KiB of them): they arrive in
# one round trip on any working link, and 10 s leaves room for a slow one with a lost packet or two
# (TCP retransmits after 1, 2, 4 s). A client that opens connections and never finishes their headers
# holds each one no longer than this.
HEADER_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Connections(_Checked):
    """What the server takes from a connection before it is a request (serve/connections.py and
    serve/asgi.py carry them out)."""

    header_timeout_s: float = _flag(
        HEADER_TIMEOUT_S,
        "a connection whose request line and headers are not whole this long after it opened (or "
        "after the first byte of its next request) is closed",
        flag="--header-timeout",
        metavar="SECONDS",
    )
    max_connections: Optional[int] = _flag(
        None,
        "connections open at once; past it a new one gets 503 and is closed (default: what the "
        "open-file limit, ulimit -n, leaves after the files the server holds, four listen backlogs and 64 spare)",
        metavar="N",
        type=int,
    )
    allowed_hosts: tuple[str, ...] = _flag(
        (),
        "Host names answered beyond localhost, 127.0.0.1 and [::1] ('*': any). Bound to a loopback "
        "address the server answers only those (another name is a web page rebinding its own name to "
        "this machine: 421); bound elsewhere, any name unless this is given",
        metavar="NAME[,NAME...]",
        type=host_list,
    )


def add_flags(p: argparse.ArgumentParser, cls) -> None:
    """The flags of ``cls``'s fields (Limits, Connections), each with its declared help and default."""
    for f in fields(cls):
        argument = {k: v for k, v in f.metadata.items() if k not in ("help", "flag")}
        argument.setdefault("type", finite_float if isinstance(f.default, float) else int)
        p.add_argument(flag_name(f), dest=f.name, default=f.default or None, help=f.metadata["help"], **argument)


def from_flags(cls, args: argparse.Namespace):
    """``cls`` (Limits, Connections) of the flags named as its fields (those given); a value out of range is a
    UsageError (exit 2) naming the flag."""
    try:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name) is not None})
    except ValueError as e:  # the class names the flag
        raise UsageError(str(e)) from None
