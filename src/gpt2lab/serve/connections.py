"""The connections in front of the app, before any is a request: uvicorn's HTTP protocol (one object
per connection) with a deadline for the request head and a cap on open connections, and the event
loop's accept errors as one log line.

uvicorn closes a kept-alive connection that idles between requests (``timeout_keep_alive``) and can
answer 503 past ``limit_concurrency``, but only once a request's head is whole: a client that opens
connections and never finishes their headers holds each one, and its file descriptor, for ever; enough
of them exhaust the process's open files, the event loop logs a traceback for every refused accept,
and no one is served. So (``guarded``, a subclass of the protocol class uvicorn would pick):

- **head deadline**: from a connection's start, and from the first byte of each next request on a
  kept-alive one, its request line and headers must be whole within ``--header-timeout`` seconds;
  else the connection is closed (with a 408 when part of a request came). The body has its own
  deadline (asgi.BODY_TIMEOUT_S).
- **connection cap**: past ``--max-connections`` open at once, a new connection gets a 503 and is
  closed at once, freeing its descriptor; the listen queue holds the rest. The default fits the
  process's open-file limit (``with_cap``).
- **quiet**: the cap reached, heads timed out, an accept out of open files: each is one warning line
  (logger ``gpt2lab.serve.connections``), then at most one a minute with the count since.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import replace
from typing import Any, Optional

from gpt2lab.serve.errors import error_body
from gpt2lab.serve.limits import Connections
from gpt2lab.system.errors import UsageError

log = logging.getLogger("gpt2lab.serve.connections")

# uvicorn's default listen backlog, the most the server takes: asyncio accepts up to the backlog's
# number of connections in each turn of its loop, each taking a descriptor, and a connection reaches
# the protocol two turns after its accept, its descriptor freed the turn after a refusal. So up to
# IN_FLIGHT backlogs of descriptors are taken before the first over the cap is freed: the cap leaves
# them free, and the backlog is a sixteenth of the open-file limit at most.
BACKLOG = 2048
IN_FLIGHT = 4
# Descriptors the process opens besides its connections while it serves, each for a moment: a module
# imported late, a file torch or a library reads; a few at most, 64 to spare. What it holds for good
# (stdio, the listening socket, the event loop's) is counted when the server starts.
SPARE_FILES = 64
SAY_EVERY_S = 60.0  # a condition said once is said again at most this often, with its count


def open_file_limit() -> Optional[int]:
    """The process's soft limit on open files (``ulimit -n``); None where it has none or none is known."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def open_files() -> int:
    """How many descriptors the process holds now (0 where the system does not list them)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return len(os.listdir(folder))
    return 0


def backlog(limit: Optional[int]) -> int:
    """The listen backlog: uvicorn's, or a sixteenth of a smaller open-file limit (IN_FLIGHT backlogs
    of descriptors must leave room for the connections)."""
    return BACKLOG if limit is None else max(16, min(BACKLOG, limit // 16))


def with_cap(options: Connections, limit: Optional[int] = None, held: Optional[int] = None) -> Connections:
    """``options`` with ``max_connections`` set: by default the open-file ``limit`` less the descriptors
    ``held`` now, IN_FLIGHT backlogs and SPARE_FILES (None without a limit); a cap the limit cannot hold
    is a UsageError naming --max-connections. ``limit`` and ``held`` default to this process's."""
    limit = open_file_limit() if limit is None else limit
    held = open_files() if held is None else held
    if limit is None:
        return options
    room = limit - held
    if options.max_connections is None:
        return replace(options, max_connections=max(1, room - IN_FLIGHT * backlog(limit) - SPARE_FILES))
    if options.max_connections > room:
        raise UsageError(
            f"--max-connections {options.max_connections}: this process may open {limit} files (ulimit -n) "
            f"and holds {held}, so at most {room} connections fit; raise the limit (ulimit -n) or lower "
            "--max-connections"
        )
    return options


class Say:
    """Warnings by condition: the first at once, then at most one each SAY_EVERY_S with how many
    times it happened since the last."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.since: dict[str, int] = {}

    def __call__(self, condition: str, message: str) -> None:
        now = time.monotonic()
        n = self.since[condition] = self.since.get(condition, 0) + 1
        if condition in self.last and now - self.last[condition] < SAY_EVERY_S:
            return
        if condition in self.last:
            message += f" ({n} times in the last {now - self.last[condition]:.0f} s)"
        log.warning("gpt2lab serve: %s", message)
        self.last[condition], self.since[condition] = now, 0


def _answer(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP response with OpenAI's error body, closing the connection."""
    body = json.dumps(error_body(message, "server_error", code=code)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class _Guard:
    """The head deadline and the cap, over uvicorn's protocol (h11's or httptools'): both keep the open
    connections in ``self.connections`` and the request being answered in ``self.cycle``, a new one
    once a request's head is whole."""

    options: Connections  # set by ``guarded``
    say: Say
    dropped: Any  # a prometheus Counter by reason (serve/metrics.py)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)  # counts it in self.connections
        self._head_timer: Optional[asyncio.TimerHandle] = None
        self._head_bytes = 0
        cap = self.options.max_connections
        if cap is not None and len(self.connections) > cap:
            self.dropped.labels("max_connections").inc()
            self.say("cap", f"{cap} connections are open (--max-connections): new ones get 503 and are closed")
            message = f"this server has {cap} connections open, its limit (--max-connections); retry shortly"
            transport.write(_answer(503, "Service Unavailable", message, "too_many_connections"))
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        if self._head_timer is None and (before is None or before.response_complete):
            self._arm()  # the first bytes of the next request on a kept-alive connection
        self._head_bytes += len(data)
        super().data_received(data)
        if self.cycle is not before:  # a request's head is whole: the app has it now
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._head_bytes = 0
        self._head_timer = asyncio.get_running_loop().call_later(self.options.header_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        limit = self.options.header_timeout_s
        self.dropped.labels("header_timeout").inc()
        self.say("head", f"closed a connection whose request head was not whole within {limit:g} s (--header-timeout)")
        if self._head_bytes:  # part of a request came: say why it ends
            message = f"the request's headers were not whole within {limit:g} s (--header-timeout); send them at once"
            self.transport.write(_answer(408, "Request Timeout", message, "request_timeout"))
        self.transport.close()


def guarded(base: type, options: Connections, say: Say, dropped) -> type:
    """``base`` (uvicorn's HTTP protocol class) with the head deadline and the cap of ``options``
    (``with_cap``d); each connection closed early is counted in ``dropped`` by its reason."""
    return type(f"Guarded{base.__name__}", (_Guard, base), {"options": options, "say": say, "dropped": dropped})


class QuietAccept(logging.Filter):
    """The event loop's "socket.accept() out of system resource" (out of open files, or of memory) as one
    warning (``say``), not a traceback per refused connection; a filter of the ``asyncio`` logger, where the
    loop's default exception handler writes it."""

    def __init__(self, say: Say) -> None:
        super().__init__()
        self.say = say

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not (str(record.msg).startswith("socket.accept() out of system resource") and isinstance(exc, OSError)):
            return True
        limit = open_file_limit()
        self.say(
            "accept",
            f"cannot accept connections: {exc.strerror}"
            + (f" (the open-file limit is {limit}, ulimit -n)" if limit else "")
            + "; they wait in the listen queue; raise the limit or lower --max-connections",
        )
        return False
