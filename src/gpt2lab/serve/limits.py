"""What a serving worker takes on, and what the server takes from a connection before it is a
request; torch-free, so the CLI's flags can show the defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Limits:
    """What one worker takes on (the ``gpt2lab serve`` flags of the same names)."""

    max_batch: int = 16  # rows (prompt x sample streams) generated together, or taking turns
    max_queue: int = 64  # requests accepted and waiting for a row; past it: 429
    max_tokens: int = 1024  # the largest max_tokens a request may ask for
    timeout_s: float = 600.0  # a request still running after this ends with an error
    prefill_chunk: int = 256  # prompt tokens run per step while other rows decode (batch mode)

    def __post_init__(self) -> None:
        """Every limit positive (a zero --max-batch would never admit a row); the error names the
        serve flag of the field."""
        for name in ("max_batch", "max_queue", "max_tokens", "timeout_s", "prefill_chunk"):
            value = getattr(self, name)
            if not value > 0:
                flag = "--timeout" if name == "timeout_s" else "--" + name.replace("_", "-")
                raise ValueError(f"{flag} {value}: must be " + ("positive" if name == "timeout_s" else "at least 1"))


# A request's headers are a few hundred bytes (uvicorn takes at most 16 KiB of them): they arrive in
# one round trip on any working link, and 10 s leaves room for a slow one with a lost packet or two
# (TCP retransmits after 1, 2, 4 s). A client that opens connections and never finishes their headers
# holds each one no longer than this.
HEADER_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Connections:
    """What the server takes from a connection before it is a request (the ``gpt2lab serve`` flags
    ``--header-timeout``, ``--max-connections``, ``--allowed-hosts``; serve/connections.py and
    serve/asgi.py carry them out)."""

    header_timeout_s: float = HEADER_TIMEOUT_S  # a connection without a whole request head by then is closed
    max_connections: Optional[int] = None  # open at once; None: from the open-file limit (connections.py)
    allowed_hosts: tuple[str, ...] = ()  # Host names served beyond the loopback ones ("*": any)

    def __post_init__(self) -> None:
        if not self.header_timeout_s > 0:
            raise ValueError(f"--header-timeout {self.header_timeout_s}: must be positive")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"--max-connections {self.max_connections}: must be at least 1")
