"""The connections in front of the app, over real sockets against a real server: connections that
never finish their request head are closed at --header-timeout (a 408 when part of a request came)
while requests go on being served, a kept-alive connection's next head has the same deadline from its
first byte; past --max-connections a new connection is refused at once, quietly, and served again
once one closes; the default cap fits the open-file limit; and a server bound to loopback answers
only loopback Host names (DNS rebinding: 421), --allowed-hosts adding more."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest
from conftest import guarded_server, until_closed

from gpt2lab.serve.connections import IN_FLIGHT, SPARE_FILES, backlog, with_cap
from gpt2lab.serve.limits import Connections
from gpt2lab.system.errors import UsageError

httpx = pytest.importorskip("httpx")

HALF_HEAD = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # the blank line that ends it never comes


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def _metrics(client, url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get(url + "/metrics", timeout=30).text
    return {
        (s.name, *sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


def _error_of(raw: bytes) -> tuple[int, dict]:
    """(status, OpenAI error) of a whole HTTP response the server wrote before closing."""
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def _said(caplog, capfd) -> list[str]:
    """The connection guard's log lines; and no traceback anywhere (a log record's or on stderr)."""
    assert not [r for r in caplog.records if r.exc_info] and "Traceback" not in capfd.readouterr().err
    return [r.getMessage() for r in caplog.records if r.name == "gpt2lab.serve.connections"]


def test_connections_that_never_finish_their_headers_are_closed_at_the_deadline(gpt2_vocab_export, caplog, capfd):
    _, d = gpt2_vocab_export
    deadline = 1.0
    with guarded_server(d, Connections(header_timeout_s=deadline)) as url:
        socks, opened = [], []
        for i in range(200):  # every other one sends half a request head, the rest nothing
            s = socket.create_connection(_address(url), timeout=10)
            if i % 2:
                s.sendall(HALF_HEAD)
            socks.append(s)
            opened.append(time.monotonic())
        t0 = time.monotonic()
        during = httpx.get(url + "/v1/models", timeout=30)
        assert during.status_code == 200 and during.json()["data"][0]["id"] == "tiny"
        assert time.monotonic() - t0 < deadline  # served while all 200 were still open
        closed = until_closed(socks, timeout=deadline + 10)
        assert sorted(closed) == list(range(200))  # the server closed every one
        for i, (when, sent) in closed.items():
            assert 0.9 * deadline <= when - opened[i] <= deadline + 3.0, (i, when - opened[i])
            if i % 2:
                status, err = _error_of(sent)
                assert status == 408 and err["code"] == "request_timeout" and "--header-timeout" in err["message"]
            else:
                assert sent == b""  # nothing asked, nothing answered
        after = httpx.get(url + "/v1/models", timeout=30)
        assert after.status_code == 200
        m = _metrics(httpx, url)
        assert m[("gpt2lab_connections_dropped_total", ("reason", "header_timeout"))] == 200
        for s in socks:
            s.close()
    said = _said(caplog, capfd)
    assert len(said) == 1 and "request head was not whole within 1 s" in said[0]  # one line, not 200


def test_a_head_in_pieces_within_the_deadline_is_served_and_each_next_head_has_the_deadline(gpt2_vocab_export):
    _, d = gpt2_vocab_export
    deadline = 1.0
    with guarded_server(d, Connections(header_timeout_s=deadline)) as url:
        s = socket.create_connection(_address(url), timeout=10)
        s.sendall(HALF_HEAD)
        time.sleep(0.6 * deadline)
        s.sendall(b"\r\n")  # the head is whole 0.6 deadlines after it began: served
        response = b""
        while b'"object":"list"' not in response:
            response += s.recv(65536)
        assert response.startswith(b"HTTP/1.1 200 ")
        time.sleep(0.6 * deadline)  # kept alive, idle (uvicorn's own idle limit is 5 s)
        started = time.monotonic()
        s.sendall(b"GET /v1/models HTTP/1.1\r\n")  # the next request's head, never finished
        ((when, sent),) = until_closed([s], timeout=deadline + 10).values()
        assert 0.9 * deadline <= when - started <= deadline + 3.0  # from its first byte, not the last answer
        assert _error_of(sent)[0] == 408
        s.close()


def test_past_max_connections_a_new_one_is_refused_at_once_and_served_once_one_closes(gpt2_vocab_export, caplog, capfd):
    _, d = gpt2_vocab_export
    with guarded_server(d, Connections(max_connections=4, header_timeout_s=60)) as url:
        holders = [socket.create_connection(_address(url), timeout=10) for _ in range(3)]
        with httpx.Client() as watcher:  # the 4th: one kept-alive connection, read /metrics on it

            def open_now() -> float:
                return _metrics(watcher, url)[("gpt2lab_open_connections",)]

            deadline = time.monotonic() + 10
            while open_now() != 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert open_now() == 4
            refused = 0
            for _ in range(5):  # a 5th: refused in well under a second, 503 or closed
                t0 = time.monotonic()
                try:
                    r = httpx.get(url + "/v1/models", timeout=10)
                    assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
                    assert "--max-connections" in r.json()["error"]["message"]
                except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError, httpx.WriteError):
                    pass  # the close reached the client before the 503 did
                assert time.monotonic() - t0 < 2.0
                refused += 1
            holders.pop().close()
            while open_now() != 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert httpx.get(url + "/v1/models", timeout=10).status_code == 200  # room again
            m = _metrics(watcher, url)
            assert m[("gpt2lab_connections_dropped_total", ("reason", "max_connections"))] == refused
        for s in holders:
            s.close()
    said = _said(caplog, capfd)
    assert len(said) == 1 and "4 connections are open (--max-connections)" in said[0]


def test_the_default_cap_leaves_the_open_file_limit_room():
    # 1024 files (a common default), 40 held: a backlog of 1024 // 16 = 64, IN_FLIGHT backlogs and
    # SPARE_FILES stay free
    assert backlog(1024) == 64 and backlog(1 << 20) == 2048
    c = with_cap(Connections(), limit=1024, held=40)
    assert c.max_connections == 1024 - 40 - IN_FLIGHT * 64 - SPARE_FILES == 664
    assert with_cap(Connections(max_connections=900), limit=1024, held=40).max_connections == 900
    with pytest.raises(UsageError, match=r"--max-connections 1000: .* 1024 files .* holds 40, so at most 984"):
        with_cap(Connections(max_connections=1000), limit=1024, held=40)


@pytest.mark.parametrize(
    "host,allowed,refused",  # refused: the name the 421 says to allow, None when served
    [
        ("localhost:{port}", (), None),
        ("127.0.0.1", (), None),
        ("[::1]:{port}", (), None),
        ("LOCALHOST.", (), None),
        ("evil.example:{port}", (), "evil.example"),
        ("127.0.0.1.evil.example", (), "127.0.0.1.evil.example"),
        ("evil.example", ("evil.example",), None),
        ("other.example:{port}", ("evil.example",), "other.example"),
        ("other.example", ("*",), None),
        ("[fd00::1]:{port}", ("fd00::1",), None),
        ("[fd00::2]", ("[fd00::1]",), "fd00::2"),
    ],
)
def test_bound_to_loopback_only_loopback_host_names_are_answered(gpt2_vocab_export, host, allowed, refused):
    _, d = gpt2_vocab_export
    with guarded_server(d, Connections(allowed_hosts=allowed)) as url:
        header = host.format(port=_address(url)[1])
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 1},
            headers={"Host": header},
            timeout=30,
        )
        assert r.status_code == (200 if refused is None else 421), r.text
        if refused is not None:
            err = r.json()["error"]
            assert err["code"] == "invalid_host" and repr(header) in err["message"]
            assert err["message"].endswith(f"start gpt2lab serve with --allowed-hosts {refused}")
            # the server goes on serving loopback names
            assert httpx.get(url + "/v1/models", timeout=30).status_code == 200


def test_bound_elsewhere_any_host_name_is_answered_unless_allowed_hosts_says(gpt2_vocab_export):
    _, d = gpt2_vocab_export
    for allowed, status in (((), 200), (("api.example",), 421)):
        with guarded_server(d, Connections(allowed_hosts=allowed), host="0.0.0.0") as url:
            port = _address(url)[1]
            r = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Host": "evil.example"}, timeout=30)
            assert r.status_code == status
            ok = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Host": "api.example"}, timeout=30)
            assert ok.status_code == 200
