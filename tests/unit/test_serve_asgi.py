"""The ASGI middleware in front of the app (serve/asgi.py): a body past the 1 MiB cap is refused
with 413 however it is framed, reading no more than the cap (and the drain) of it; a body that never
ends gets 408 at its deadline; the app never sees either."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")


def test_a_chunked_body_over_the_cap_gets_413_and_the_server_goes_on(pair_server):
    """Without Content-Length (Transfer-Encoding: chunked) the 1 MiB cap holds as the body is read: a
    valid 10 MiB request (its prompt padded with JSON whitespace) is refused, not read and answered."""
    url, _ = pair_server
    head, tail = b'{"model": "tiny", "prompt": "x", "max_tokens": 1', b"}"

    def body():
        yield head
        for _ in range(160):
            yield b" " * (1 << 16)
        yield tail

    r = httpx.post(url + "/v1/completions", content=body(), headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and f"at most {1 << 20}" in err["message"]
    small = httpx.post(
        url + "/v1/completions",
        content=b"".join([head, b" " * 1000, tail]),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )  # the same, under the cap
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 1


# an ASGI request as a client sends a chunked body: no Content-Length to refuse it by
_CHUNKED_POST = {
    "type": "http",
    "method": "POST",
    "path": "/v1/completions",
    "client": ("127.0.0.1", 1),
    "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
}


def test_a_body_that_never_ends_gets_408_after_the_deadline(monkeypatch):
    """At the ASGI level: a client that sends a first piece and then nothing (slow loris) is answered 408
    with OpenAI's error body once the body deadline passes, and the app never sees the request."""
    import asyncio
    import json

    from gpt2lab.serve import asgi
    from gpt2lab.serve.app import ROUTES
    from gpt2lab.serve.metrics import ServeMetrics

    monkeypatch.setattr(asgi, "BODY_TIMEOUT_S", 0.2)
    sent, first = [], [True]

    async def receive():
        if first[0]:
            first[0] = False
            return {"type": "http.request", "body": b'{"model": ', "more_body": True}
        await asyncio.sleep(3600)  # the rest never comes

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        raise AssertionError("the app was handed a body that never ended")

    scope = _CHUNKED_POST
    asyncio.run(asyncio.wait_for(asgi.AccessLog(app, ServeMetrics(), ROUTES)(scope, receive, send), 10))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 408
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_timeout"


def test_the_body_cap_stops_reading_once_past_it():
    """At the ASGI level: from an endless chunked body the middleware takes one message past the cap,
    answers 413 with OpenAI's error body, and the app never sees the request."""
    import asyncio
    import json

    from gpt2lab.serve.app import ROUTES
    from gpt2lab.serve.asgi import DRAIN_BYTES, MAX_BODY_BYTES, AccessLog
    from gpt2lab.serve.metrics import ServeMetrics

    pulled, sent = [0], []

    async def receive():
        pulled[0] += 1
        return {"type": "http.request", "body": b" " * 65536, "more_body": True}

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        raise AssertionError("the app was handed an oversized body")

    scope = _CHUNKED_POST
    asyncio.run(AccessLog(app, ServeMetrics(), ROUTES)(scope, receive, send))
    # the cap, one message past it, then what _drain throws away so the client can read its 413
    assert pulled[0] == (MAX_BODY_BYTES + DRAIN_BYTES) // 65536 + 1
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["type"] == "invalid_request_error"
