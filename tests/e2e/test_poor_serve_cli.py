"""Issue 22: Ctrl-C ends `gpt2lab serve` with exit 130 (a real process and a real SIGINT; the port
errors are in unit/test_poor_serve.py)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("uvicorn", reason="gpt2lab serve needs the serve extra (fastapi, uvicorn)")


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
