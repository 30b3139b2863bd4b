"""Bad requests: every kind is answered with a 4xx and OpenAI's error body naming its field (bad JSON,
a body that is not UTF-8 or not sent as JSON, an unknown model, even one whose name cannot be
encoded, wrong types (booleans are not integers), values out of range, token ids past the
vocabulary, a context too long, in words that say what the request asked), unknown routes and wrong
methods included, and the server goes on serving; in both server modes where it matters."""

from __future__ import annotations

import pytest
from conftest import openai_client, post_chat, post_completion

from gpt2lab import get_tokenizer

openai = pytest.importorskip("openai", reason="the serve tests use the official openai client (test extra)")
httpx = pytest.importorskip("httpx")


@pytest.mark.parametrize(
    "body,status,needle",
    [
        (b'{"model": "tiny", "prompt": ', 400, "not valid JSON"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 200}, 400, "maximum context length is 128"),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
        ({"model": "tiny", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
        ({"model": "tiny", "prompt": [60000]}, 400, "token ids are 0 to 50256"),
        ({"model": "tiny", "prompt": "x", "max_new_tokens": 5}, 400, "unrecognized request argument"),
        ({"model": "tiny", "prompt": "x", "logprobs": 6}, 400, "logprobs"),
        ({"model": "tiny", "prompt": "x", "logit_bias": {"1": 5}}, 400, "logit_bias is not supported"),
        ({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
        ({"prompt": "x"}, 400, "model"),
        (b'{"model": "tiny", "prompt": "x", "temperature": Infinity}', 400, "temperature"),
        (b'{"model": "tiny", "prompt": "x", "temperature": 1e999}', 400, "temperature"),
        (b'{"model": "tiny", "prompt": "x", "top_p": NaN}', 400, "top_p"),
        (b'{"model": "tiny", "prompt": "x", "presence_penalty": -Infinity}', 400, "presence_penalty"),
        # an integer past the 4,300 digits Python reads from text: the field and what it takes, not "error parsing"
        (
            b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 4999 + b"}",
            400,
            "max_tokens: an integer of 5000 digits; max_tokens takes an integer >= 0",
        ),
        (
            b'{"model": "tiny", "prompt": "x", "seed": -' + b"9" * 5000 + b"}",
            400,
            f"seed takes an integer >= 0 and < {2**63}",
        ),
        (b'{"model": "tiny", "prompt": [1, 2, ' + b"7" * 4400 + b"]}", 400, "prompt: an integer of 4400 digits"),
    ],
)
def test_bad_requests_get_4xx_with_an_openai_error_and_the_server_keeps_serving(pair_server, body, status, needle):
    url, _ = pair_server
    kw = (
        {"content": body, "headers": {"Content-Type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx.post(url + "/v1/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    ok = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_models_list_and_client_errors(pair_server):
    url, _ = pair_server
    c = openai_client(url)
    assert [m.id for m in c.models.list()] == ["tiny", "twin"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.completions.create(model="gpt2-xxl", prompt="x")
    with pytest.raises(openai.BadRequestError, match="context length"):
        c.completions.create(model="tiny", prompt="word " * 120, max_tokens=16)
    page = httpx.get(url + "/", timeout=30)
    assert page.status_code == 200 and "<script>" in page.text and "/v1/completions" in page.text


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"messages": []}, "at least one message"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role 'tool'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "only text parts",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs is not supported"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "unrecognized request argument: tools"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 500}, "maximum context length is 128"),
    ],
)
def test_bad_chat_requests_get_a_400_with_openais_error(tiny_server, body, needle):
    url, _ = tiny_server
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "method,path,status",
    [
        ("GET", "/v1/nothing", 404),
        ("POST", "/v1/engines", 404),
        ("GET", "/v1/completions", 405),
        ("GET", "/v1/chat/completions", 405),
        ("DELETE", "/v1/models", 405),
    ],
)
def test_unknown_routes_and_wrong_methods_answer_openais_error_body(tiny_server, method, path, status):
    url, _ = tiny_server
    r = httpx.request(method, url + path, timeout=30)
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert f"({method} {path})" in err["message"]
    if status == 405:
        assert ("POST" if "completions" in path else "GET") in r.headers["allow"]


@pytest.mark.parametrize("path", ["/", "/metrics", "/v1/models"])
def test_head_on_a_get_route_answers_as_get_without_a_body(tiny_server, path):
    """HTTP's HEAD is GET without the body (RFC 9110), which health checks and proxies send."""
    url, _ = tiny_server
    got, head = httpx.get(url + path, timeout=30), httpx.head(url + path, timeout=30)
    assert head.status_code == got.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]


# JSON's "\ud800" without its pair: a lone surrogate, which no text holds (json.dumps keeps it escaped)
@pytest.mark.parametrize(
    "path,body,param,said",
    [
        ("completions", {"\ud800": 1, "model": "tiny", "prompt": "x"}, "\\ud800", "unrecognized request argument"),
        ("completions", {"model": "tiny", "prompt": "x", "\udfff\ud800": 1}, "\\udfff\\ud800", "unrecognized"),
        ("completions", {"model": "\ud800", "prompt": "x"}, "model", "lone UTF-16 surrogate (\\ud800 at character 0)"),
        ("completions", {"model": "tiny", "prompt": "ok \udc00"}, "prompt", "(\\udc00 at character 3)"),
        ("completions", {"model": "tiny", "prompt": ["a", "b\ud800"]}, "prompt[1]", "lone UTF-16 surrogate"),
        ("completions", {"model": "tiny", "prompt": "a\ud800b", "stream": True}, "prompt", "lone UTF-16 surrogate"),
        ("completions", {"model": "tiny", "prompt": "x", "stop": ["\ud800"]}, "stop[0]", "lone UTF-16 surrogate"),
        (
            "completions",
            {"model": "tiny", "prompt": "x", "stream_options": {"\ud800": True}},
            "stream_options.\\ud800",
            "unrecognized request argument",
        ),
        (
            "chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi", "\ud800": 2}]},
            "messages[0].\\ud800",
            "unrecognized request argument",
        ),
        (
            "chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "h\ud800i"}]},
            "messages[0].content",
            "lone UTF-16 surrogate",
        ),
    ],
)
def test_a_lone_surrogate_in_a_key_or_a_value_is_a_400_naming_it(tiny_server, path, body, param, said):
    import json

    url, _ = tiny_server
    r = httpx.post(
        f"{url}/v1/{path}", content=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, timeout=30
    )
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    err = r.json()["error"]
    assert err["param"] == param and said in err["message"] and err["type"] == "invalid_request_error"


def test_a_surrogate_pair_is_one_character_of_text(tiny_server):
    url, _ = tiny_server
    ok = post_completion(url, b'{"model": "tiny", "prompt": "\\ud83d\\ude00", "max_tokens": 1}')
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == len(get_tokenizer().encode("\U0001f600"))
    key = post_completion(url, b'{"model": "tiny", "prompt": "x", "\\ud83d\\ude00": 1}')
    assert key.status_code == 400 and key.json()["error"]["message"] == "unrecognized request argument: \U0001f600"


@pytest.mark.parametrize(
    "headers", [{"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}]
)
def test_a_body_without_json_content_type_is_refused_naming_the_header(tiny_server, headers):
    url, _ = tiny_server
    r = post_completion(url, {"model": "tiny", "prompt": "x", "max_tokens": 1}, **headers)
    assert r.status_code == 415, r.text
    msg = r.json()["error"]["message"]
    assert "Content-Type: application/json" in msg and headers["Content-Type"] in msg


def test_a_body_with_no_content_type_header_is_refused_naming_the_header(tiny_server):
    url, _ = tiny_server
    r = httpx.post(url + "/v1/completions", content=b'{"model": "tiny", "prompt": "x"}', timeout=60)
    assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"]["message"]
    ok = post_completion(
        url, {"model": "tiny", "prompt": "x", "max_tokens": 1}, **{"Content-Type": "application/json; charset=utf-8"}
    )
    assert ok.status_code == 200, ok.text


def test_a_body_that_is_not_utf8_is_named_as_such(tiny_server):
    url, _ = tiny_server
    body = b'{"model": "tiny", "prompt": "caf\xe9"}'  # Latin-1
    r = post_completion(url, body)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "not UTF-8" in msg and f"byte 0xe9 at position {body.index(0xE9)}" in msg


@pytest.mark.parametrize(
    "path,field,value",
    [
        ("completions", "max_tokens", True),
        ("completions", "n", True),
        ("completions", "seed", False),
        ("completions", "top_k", True),
        ("completions", "logprobs", True),
        ("completions", "prompt", [True, False]),
        ("completions", "prompt", [[1, True]]),
        ("completions", "stream", 1),
        ("chat/completions", "max_tokens", True),
        ("chat/completions", "max_completion_tokens", True),
        ("chat/completions", "n", True),
    ],
)
def test_booleans_are_not_integers_nor_integers_booleans(tiny_server, path, field, value):
    url, _ = tiny_server
    body = (
        {"model": "tiny", "prompt": "x"}
        if path == "completions"
        else {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    )
    r = httpx.post(f"{url}/v1/{path}", json={**body, field: value}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(f"{field}: ") and f"(got {value!r})" in err["message"]


@pytest.mark.parametrize(
    "prompt,where,bad,position", [([-1, 5], "prompt", -1, 0), ([[5], [3, 50257]], "prompt[1]", 50257, 1)]
)
def test_a_token_id_out_of_range_names_the_prompt_and_the_range(tiny_server, prompt, where, bad, position):
    url, _ = tiny_server
    r = post_completion(url, {"model": "tiny", "prompt": prompt})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt"
    assert err["message"] == (
        f"{where}: token id {bad} at position {position} is out of range: this model's token ids are 0 to 50256"
    )


def test_a_context_error_says_what_the_request_asked(tiny_server):
    """No max_tokens sent: chat's default is what the context leaves, so a conversation that fills the
    context is too long by itself; a completion's default is 16, and the message says it is the default."""
    url, _ = tiny_server
    enc = get_tokenizer()
    content = "word " * 130
    n = len(enc.encode(f"User: {content}\nAssistant:"))  # inference/chat.py's plain template, written out by hand
    r = post_chat(url, {"messages": [{"role": "user", "content": content}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert err["message"] == (
        f"This model's maximum context length is 128 tokens, and the messages alone take {n} "
        "tokens (as the chat template writes them). Shorten the messages."
    )
    prompt = "word " * 119
    m = len(enc.encode(prompt))
    r = post_completion(url, {"model": "tiny", "prompt": prompt})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        f"This model's maximum context length is 128 tokens; you asked for {m + 16} ({m} in the prompt, "
        "max_tokens' default of 16). Shorten the prompt or lower max_tokens."
    )
