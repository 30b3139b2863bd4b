"""What a serving worker takes on; torch-free, so the CLI's flags can show the defaults."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """What one worker takes on (the ``gpt2lab serve`` flags of the same names)."""

    max_batch: int = 16  # rows (prompt x sample streams) generated together; in turns, requests
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
