"""A running ``gpt2lab serve`` app for tests: uvicorn in a thread, on a free port."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import pytest


@contextmanager
def running_server(models: list[str]) -> Iterator[str]:
    """Load ``models`` ([NAME=]MODEL, as on the command line) on CPU, serve them; yield the base URL."""
    uvicorn = pytest.importorskip("uvicorn", reason="gpt2lab serve needs the serve extra (fastapi, uvicorn)")
    from gpt2lab.commands.serve import load_workers
    from gpt2lab.serve.api import create_app

    workers = load_workers(models, "cpu", "float32")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # port 0: the OS picks a free one, held from here on
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(workers), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        for w in workers.values():
            w.close()
        sock.close()
