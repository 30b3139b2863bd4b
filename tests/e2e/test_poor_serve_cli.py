"""Issue 22's poor `gpt2lab serve` start and stop cases, in real processes: a port in use and a port
out of range are one line and exit 2; Ctrl-C ends the server with exit 130."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import run_gpt2lab

pytest.importorskip("uvicorn", reason="gpt2lab serve needs the serve extra (fastapi, uvicorn)")


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip() and "dtype" not in line]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_port_in_use_is_one_line_and_exit_2(gpt2_vocab_export):
    _, d = gpt2_vocab_export
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        r = run_gpt2lab("serve", "--model", d, "--device", "cpu", "--port", str(port))
    finally:
        holder.close()
    assert r.returncode == 2, r.stderr
    assert one_line(r.stderr) == (f"gpt2lab serve: --port {port} on 127.0.0.1 is in use (another server?); "
                                  "stop it or pick another --port")


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_port_out_of_range_is_one_line_and_exit_2(gpt2_vocab_export, port):
    _, d = gpt2_vocab_export
    r = run_gpt2lab("serve", "--model", d, "--device", "cpu", "--port", port)
    assert r.returncode == 2, r.stderr
    assert one_line(r.stderr) == f"gpt2lab serve: --port {port}: must be 0 to 65535 (0 lets the system pick a free one)"


def test_ctrl_c_stops_the_server_with_exit_130(gpt2_vocab_export):
    import httpx

    _, d = gpt2_vocab_export
    p = subprocess.Popen([sys.executable, "-m", "gpt2lab", "serve", "--model", f"tiny={d}", "--device", "cpu",
                          "--port", "0"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while " at http://" not in (line := p.stderr.readline()):
            assert line and time.monotonic() < deadline, "the server did not start"
        url = line.split(" at ")[1].split("/ ")[0]
        assert httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"] == "tiny"  # it serves
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=60) == 130
        assert p.stderr.read().strip().splitlines()[-1] == "gpt2lab serve: interrupted"
    finally:
        if p.poll() is None:
            p.kill()
