"""The raw ASGI middleware in front of the app (``AccessLog``): a request for a Host name the server
does not answer refused (421, ``HostCheck``); each request's body read whole whatever its framing,
refused past MAX_BODY_BYTES (413, drained first so the client reads it) or when not whole
BODY_TIMEOUT_S after the request began (408); a client that left while sending gets nothing; one
access-log line (logger ``gpt2lab.serve.access``) and one ``/metrics`` count per request."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from typing import Optional, Sequence

from gpt2lab.serve.errors import APIError
from gpt2lab.serve.metrics import ServeMetrics

# A request body past this is refused (413), unread when its Content-Length says so, else as soon
# as this much has come: GPT-2's longest context is 1024 tokens, a few KB of text; 1 MiB leaves
# room for token-id lists and many prompts.
MAX_BODY_BYTES = 1 << 20
access_log = logging.getLogger("gpt2lab.serve.access")


class BodyTooLarge(Exception):
    pass


# A body not whole this many seconds after its request began is refused (408): a client that opens
# requests and trickles their bodies (or never ends them) would otherwise hold a connection and its
# buffer for as long as it likes. The largest body taken, 1 MiB, arrives in well under a second on
# any link a server is reached over; 30 s leaves room for a slow one (35 KB/s).
BODY_TIMEOUT_S = 30.0
# A body refused for its size is still read, and thrown away, up to this many bytes more (for at most
# DRAIN_S seconds) before the 413: a server that closes a connection with unread data in it makes
# the kernel reset it, and the client, still sending, never reads its answer. Nothing read is kept.
DRAIN_BYTES, DRAIN_S = 8 << 20, 2.0


async def _drain(receive) -> None:
    """Read and discard what is left of a request's body, DRAIN_BYTES at most."""
    n = 0
    while n < DRAIN_BYTES:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return
        n += len(message.get("body", b""))


BODY = "gpt2lab.body"  # the scope key of the request's body, read whole
CLOSE = {"Connection": "close"}  # an answer's header that closes the connection


async def read_body(scope, receive) -> Optional[bytes]:
    """The request's body, read whole whatever its framing (Content-Length or chunked); None if the
    client left while sending it. Past MAX_BODY_BYTES, BodyTooLarge: unread when Content-Length says
    so, else as soon as that much has come, so no more than that is ever held."""
    size = dict(scope.get("headers") or []).get(b"content-length", b"")
    if size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise BodyTooLarge(f"the request body is {int(size)} bytes; this server takes at most {MAX_BODY_BYTES}")
    parts, n = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        n += len(message.get("body", b""))
        if n > MAX_BODY_BYTES:
            raise BodyTooLarge(
                f"the request body is over {MAX_BODY_BYTES} bytes (read {n} before stopping); "
                f"this server takes at most {MAX_BODY_BYTES}"
            )
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


def is_loopback(name: str) -> bool:
    """Whether a host name or address (``[::1]`` bracketed or not) is this machine's loopback:
    ``localhost``, 127.0.0.0/8 or ::1."""
    name = name.strip("[]").lower().rstrip(".")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """A Host header's name without its port: ``[::1]:8000`` -> ``[::1]``, ``localhost:80`` -> ``localhost``."""
    if header.startswith("["):
        return header[: header.find("]") + 1] if "]" in header else header
    name, colon, port = header.rpartition(":")
    return name if colon and port.isdigit() else header


class HostCheck:
    """Which Host names the server answers. Bound to a loopback address, only loopback ones
    (``localhost``, 127.0.0.1, ``[::1]``, any port) and ``allowed`` (--allowed-hosts): a web page
    elsewhere can point a name of its own at 127.0.0.1 (DNS rebinding) and have the visitor's browser
    read this server's answers as its own site's; the browser still sends that name as the Host.
    Bound to another address, every name unless ``allowed`` is given. ``*`` in ``allowed``: every
    name. A request without a Host header (HTTP/1.0) names none and is served."""

    def __init__(self, bound: str, allowed: Sequence[str] = ()) -> None:
        self.allowed = {h.strip("[]").lower().rstrip(".") for h in allowed}  # an IPv6 address bracketed or not
        self.active = "*" not in self.allowed and (is_loopback(bound) or bool(self.allowed))

    def refusal(self, scope) -> Optional[str]:
        """Why ``scope``'s request is not served (its Host), or None when it is."""
        header = dict(scope.get("headers") or []).get(b"host")
        if not self.active or header is None:
            return None
        value = header.decode("latin-1")
        name = host_name(value.strip()).strip("[]").lower().rstrip(".")
        if is_loopback(name) or name in self.allowed:
            return None
        names = ["localhost", "127.0.0.1", "[::1]", *sorted(self.allowed)]
        return (
            f"Host {value!r} is not a name this server answers: it answers {', '.join(names[:-1])} and "
            f"{names[-1]} (a page on another site may be reaching it through a name of its own: DNS "
            f"rebinding); to serve this name, start gpt2lab serve with --allowed-hosts {name or value}"
        )


def _replay(body: bytes, receive):
    """An ASGI receive that gives ``body`` as one message, then the client's own messages (its disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


class AccessLog:
    """ASGI middleware: refuses a request for a Host name ``hosts`` does not serve (421, before its
    body is read), reads each request's body, refusing one over MAX_BODY_BYTES (413) however it
    is framed (read_body), then logs one line per request and counts it in ``/metrics`` as its
    response's last part goes out (a stream's too): before the client has it all, so what the client
    does next is logged after it."""

    def __init__(self, app, metrics: ServeMetrics, routes: tuple[str, ...], hosts: Optional[HostCheck] = None) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes  # routes: counted by path, the rest as "other"
        self.hosts = hosts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status, logged = time.monotonic(), [0], [False]

        def finished() -> None:  # once per request: counted and logged
            if logged[0]:
                return
            logged[0] = True
            client = scope.get("client") or ("-", 0)
            code = status[0] or 499  # 499: the client went away before a response started
            path = scope["path"] if scope["path"] in self.routes else "other"  # bounded label values
            self.metrics.requests.labels(path, str(code)).inc()
            access_log.info(
                '%s "%s %s" %d %.3fs', client[0], scope["method"], scope["path"], code, time.monotonic() - t0
            )

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished()  # before the client has the whole answer: its next request (or signal) comes after
            await send(message)

        try:
            refused = self.hosts.refusal(scope) if self.hosts is not None else None
            if refused is not None:  # the body is left unread: uvicorn reads past it to the next request
                return await APIError(421, refused, code="invalid_host").response()(scope, receive, sending)
            try:
                body = await asyncio.wait_for(read_body(scope, receive), BODY_TIMEOUT_S)
            except BodyTooLarge as e:  # Connection: close, so that the server reads no more of it than _drain
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(_drain(receive), DRAIN_S)
                return await APIError(413, str(e)).response(CLOSE)(scope, receive, sending)
            except asyncio.TimeoutError:
                why = f"the request body was not whole {BODY_TIMEOUT_S:g} s after the request began; send it at once"
                return await APIError(408, why, code="request_timeout").response(CLOSE)(scope, receive, sending)
            if body is not None:  # else the client left before its request was whole: nothing to answer
                scope[BODY] = body  # for the error that names the field of an integer too long to read
                await self.app(scope, _replay(body, receive), sending)
        finally:
            finished()  # a request that ended without its last body (the client left, an error)
