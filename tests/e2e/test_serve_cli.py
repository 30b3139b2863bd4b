"""Ctrl-C ends `gpt2lab serve` with exit 130, SIGTERM with 143 (a real process and a real signal; the port
errors are in unit/test_serve_command.py), ending the requests still open with an error."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("uvicorn", reason="gpt2lab serve needs the serve extra (fastapi, uvicorn)")


@pytest.mark.parametrize("sig, code, said", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "SIGTERM")])
def test_ctrl_c_or_sigterm_stops_the_server_with_its_exit_code(gpt2_vocab_export, sig, code, said):
    import httpx

    _, d = gpt2_vocab_export
    p = subprocess.Popen(
        [sys.executable, "-m", "gpt2lab", "serve", "--model", f"tiny={d}", "--device", "cpu", "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while " at http://" not in (line := p.stderr.readline()):
            assert line and time.monotonic() < deadline, "the server did not start"
        url = line.split(" at ")[1].split("/ ")[0]
        assert httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"] == "tiny"  # it serves
        p.send_signal(sig)
        assert p.wait(timeout=60) == code
        assert p.stderr.read().strip().splitlines()[-1] == f"gpt2lab serve: {said}; stopping"
    finally:
        if p.poll() is None:
            p.kill()


def test_ctrl_c_ends_each_open_request_with_an_error_says_one_line_and_exits_130(gpt2_vocab_export):
    """With a stream and a whole answer open: the stream's last event is OpenAI's error body ("server
    shutting down") before [DONE], the whole answer is a 503 with it, the server says it is stopping
    in one line and exits 130 (before, the stream was cut and the process went quiet for seconds)."""
    import json
    import threading

    import httpx
    from conftest import scrape

    _, d = gpt2_vocab_export
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpt2lab",
            "serve",
            "--model",
            f"tiny={d}",
            "--device",
            "cpu",
            "--port",
            "0",
            "--max-batch",
            "2",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while " at http://" not in (line := p.stderr.readline()):
            assert line and time.monotonic() < deadline, "the server did not start"
        url = line.split(" at ")[1].split("/ ")[0]
        long = {"model": "tiny", "prompt": ["x"] * 16, "n": 16, "max_tokens": 120}  # far from done at Ctrl-C
        whole: list = []
        waiting = threading.Thread(
            target=lambda: whole.append(httpx.post(url + "/v1/completions", json=long, timeout=60))
        )
        with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True}, timeout=60) as s:
            lines = (line for line in s.iter_lines() if line)
            assert next(lines).startswith("data: {")  # the stream runs
            waiting.start()
            while scrape(url)[("gpt2lab_queue_depth", ("model", "tiny"))] < 1:  # the whole answer waits its turn
                time.sleep(0.02)
            p.send_signal(signal.SIGINT)
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        err = json.loads(rest[-2][len("data: ") :])["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "server_shutting_down"
        assert err["message"].startswith("server shutting down")
        assert p.wait(timeout=30) == 130
        waiting.join(timeout=30)
        assert whole[0].status_code == 503 and whole[0].json()["error"]["code"] == "server_shutting_down"
        said = [line for line in p.stderr.read().splitlines() if "stopping" in line or "interrupted" in line]
        assert said == [
            "gpt2lab serve: interrupted; stopping (2 open requests ended with a 'server shutting down' error)"
        ]
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.slow
def test_a_flood_of_connections_past_the_open_file_limit_is_refused_quietly_and_the_server_recovers(
    gpt2_vocab_export,
):
    """Three times the process's open-file limit of connections that never finish their headers: the
    ones past the default cap are refused at once, the rest closed at --header-timeout, stderr holds
    a few warning lines and no traceback, and a normal request is served once the deadline has passed
    (before: the server ran out of files, logged a traceback per accept, and served no one)."""
    import resource
    import socket

    import httpx

    _, d = gpt2_vocab_export
    limit = 256

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    argv = ["serve", "--model", f"tiny={d}", "--device", "cpu", "--port", "0", "--header-timeout", "1"]
    p = subprocess.Popen(
        [sys.executable, "-m", "gpt2lab", *argv], stderr=subprocess.PIPE, text=True, preexec_fn=low_limit
    )
    flood = []
    try:
        deadline = time.monotonic() + 120
        while " at http://" not in (line := p.stderr.readline()):
            assert line and time.monotonic() < deadline, "the server did not start"
        url = line.split(" at ")[1].split("/ ")[0]
        cap = int(line.rsplit("up to ", 1)[1].split(" connections")[0])
        assert 0 < cap < limit
        host, port = url.removeprefix("http://").rsplit(":", 1)
        for _ in range(3 * limit):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            flood.append(s)
        served, t0 = None, time.monotonic()
        while served is None and time.monotonic() < t0 + 10:
            try:
                r = httpx.get(url + "/v1/models", timeout=5)
                served = r if r.status_code == 200 else None
            except httpx.TransportError:  # refused while the cap is full
                pass
            time.sleep(0.1)
        assert served is not None and served.json()["data"][0]["id"] == "tiny"
        assert p.poll() is None
    finally:
        for s in flood:
            s.close()
        p.terminate()
        err = p.communicate(timeout=60)[1]
    assert "Traceback" not in err and "Too many open files" not in err, err[-3000:]
    warnings = [x for x in err.splitlines() if "connections are open" in x or "request head was not whole" in x]
    assert 1 <= len(warnings) <= 4, err[-3000:]  # one line per condition, not one per connection
