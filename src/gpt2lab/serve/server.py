"""Serving the app: ``bind`` (the listening socket, its errors as one-line UsageErrors) and ``serve_here``
(uvicorn from a thread, its connections guarded: serve/connections.py; the models in the calling thread, the
engine's; at Ctrl-C the open requests end with a shutdown error before uvicorn drains)."""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from typing import Optional

from gpt2lab.serve.app import create_app
from gpt2lab.serve.batch import Worker
from gpt2lab.serve.jobs import ShuttingDown, run_engine
from gpt2lab.serve.limits import Connections
from gpt2lab.system.errors import UsageError


def serve_here(
    workers: dict[str, Worker],
    sock: socket.socket,
    client=None,
    stopping=None,
    connections: Optional[Connections] = None,
) -> None:
    """Serve ``workers`` on ``sock`` (from ``bind``; its address decides which Host names are served:
    asgi.HostCheck): uvicorn from a background thread, its connections guarded as ``connections`` says
    (serve/connections.py; its cap resolved by ``with_cap``; default: ``with_cap(Connections())``), the
    models from this one (the run_engine's docstring says why this thread). With ``client`` (a function of
    the base URL), run it in a third thread once uvicorn accepts, and stop when it returns (``gpt2lab bench
    serve``, the tests' servers); without, serve until Ctrl-C. Ctrl-C (in the start-up wait too) stops the
    models at once; every open request ends with a "server shutting down" error (a stream's last event
    before ``[DONE]``, else a 503), ``stopping`` (if given) is called with how many, and the
    KeyboardInterrupt is raised again once uvicorn has sent those and stopped (cli.main turns it into exit
    130). uvicorn.Server, not uvicorn.run: after its graceful shutdown uvicorn raises the Ctrl-C it caught
    again."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from gpt2lab.serve.connections import QuietAccept, Say, backlog, guarded, open_file_limit, with_cap

    connections = connections or with_cap(Connections())
    say = Say()
    app = create_app(workers, host=sock.getsockname()[0], allowed_hosts=connections.allowed_hosts)
    config = uvicorn.Config(
        app,
        log_level="warning",
        http=guarded(AutoHTTPProtocol, connections, say, app.state.metrics.dropped),
        backlog=backlog(open_file_limit()),
    )
    server = uvicorn.Server(config)
    quiet = QuietAccept(say)
    logging.getLogger("asyncio").addFilter(quiet)
    app.state.metrics.connections.set_function(lambda: len(server.server_state.connections))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    host, port = sock.getsockname()[:2]
    errors: list[BaseException] = []

    def drive(url: str) -> None:
        try:
            client(url)
        except BaseException as e:  # handed to the caller below
            errors.append(e)
        finally:
            for w in workers.values():
                w.close()

    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server thread did not start")
            time.sleep(0.02)
        if client is not None:
            url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
            threading.Thread(target=drive, args=(url,), name="gpt2lab-serve-client", daemon=True).start()
        run_engine(workers)
    except KeyboardInterrupt:  # nothing will answer the open requests now: end them, so that uvicorn can drain
        error = ShuttingDown("server shutting down: the request was ended before it finished; retry it later")
        ended = sum(w.shut_down(error) for w in workers.values())
        if stopping is not None:
            stopping(ended)
        raise
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        logging.getLogger("asyncio").removeFilter(quiet)
    if errors:
        raise errors[0]


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port``; a port out of range, in use or not ours to take is a
    UsageError (exit 2) naming --port or --host, not uvicorn's log line and exit 3."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port}: must be 0 to 65535 (0 lets the system pick a free one)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart at once after a stop
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            why = "is in use (another server?); stop it or pick another --port"
        elif e.errno in (errno.EACCES, errno.EPERM):
            why = "cannot be taken by this user (ports below 1024 need privileges); pick a --port above 1023"
        elif e.errno == errno.EADDRNOTAVAIL:
            raise UsageError(f"--host {host}: not an address of this machine; use 127.0.0.1 or 0.0.0.0") from None
        else:
            why = f"cannot be bound ({e.strerror})"
        raise UsageError(f"--port {port} on {host} {why}") from None
    sock.set_inheritable(True)
    return sock
