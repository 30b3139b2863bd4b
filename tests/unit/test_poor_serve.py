"""Poor serve/sample cases: a model name that cannot be encoded, temperatures and top_p
so small they overflow, a body without Content-Type: application/json, and equal prompts without a
seed; and odd or hostile requests (a lone surrogate, a body that is not UTF-8, booleans as integers,
a chat message's name or unknown key, response_format, token ids out of range, a context error's
wording); each in both server modes where it matters."""
from __future__ import annotations

import json

import pytest
import torch

from gpt2lab import cli, get_tokenizer
from gpt2lab.model.sampling import sample_next
from serve_utils import running_server

httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module", params=[False, True], ids=["batched", "turns"])
def server(request, gpt2_vocab_export):
    _, d = gpt2_vocab_export
    with running_server([f"tiny={d}"], deterministic=request.param) as url:
        yield url, d


def post(url: str, body, **headers) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # json.dumps keeps \ud800 escaped
    return httpx.post(url + "/v1/completions", content=content, timeout=60,
                      headers={"Content-Type": "application/json", **headers})


def test_a_model_name_that_cannot_be_encoded_gets_a_json_404(server):
    url, _ = server
    r = post(url, {"model": "\ud800", "prompt": "x"})
    assert r.status_code == 404 and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and "\\ud800" in err["message"] and "tiny" in err["message"]


@pytest.mark.parametrize("field,value", [("temperature", 1e-45), ("temperature", 1e-320),
                                         ("top_p", 1e-45), ("top_p", 1e-320)])
def test_tiny_temperature_and_top_p_sample_the_greedy_token(server, field, value):
    """So small a temperature (or top_p) leaves all the mass on the most likely token: greedy's text."""
    url, _ = server
    body = {"model": "tiny", "prompt": "The sea", "max_tokens": 6, "seed": 3}
    greedy = post(url, {**body, "temperature": 0})
    r = post(url, {**body, field: value})
    assert greedy.status_code == 200 and r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_sample_next_with_overflowing_temperature_is_argmax_and_ties_stay_random():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=g) * 30
    for t in (1e-45, 1e-320, 5e-324):
        assert torch.equal(sample_next(logits, t, generator=g), logits.argmax(-1))
        assert torch.equal(sample_next(logits, 1.0, top_p=t, generator=g), logits.argmax(-1))
    tie = torch.zeros(1, 2)  # two equally likely tokens: a tiny temperature draws both, as T -> 0 would
    drawn = {int(sample_next(tie, 1e-45, generator=g)) for _ in range(64)}
    assert drawn == {0, 1}


@pytest.mark.parametrize("headers", [{"Content-Type": "text/plain"},
                                     {"Content-Type": "application/x-www-form-urlencoded"}])
def test_a_body_without_json_content_type_is_refused_naming_the_header(server, headers):
    url, _ = server
    r = post(url, {"model": "tiny", "prompt": "x", "max_tokens": 1}, **headers)
    assert r.status_code == 415, r.text
    msg = r.json()["error"]["message"]
    assert "Content-Type: application/json" in msg and headers["Content-Type"] in msg


def test_a_body_with_no_content_type_header_is_refused_naming_the_header(server):
    url, _ = server
    r = httpx.post(url + "/v1/completions", content=b'{"model": "tiny", "prompt": "x"}', timeout=60)
    assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"]["message"]
    ok = post(url, {"model": "tiny", "prompt": "x", "max_tokens": 1}, **{"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_equal_prompts_without_a_seed_are_sampled_independently(server):
    url, _ = server
    r = post(url, {"model": "tiny", "prompt": ["Once", "Once", "Once"], "max_tokens": 8})
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(texts) == 3 and len(set(texts)) == 3, texts  # 8 tokens of a 50257-token vocabulary
    seeded = post(url, {"model": "tiny", "prompt": ["Once", "Once"], "max_tokens": 8, "seed": 5})
    a, b = [c["text"] for c in seeded.json()["choices"]]
    assert a == b  # with a seed each prompt reproduces `sample --seed` (documented in the README)


def test_batched_worker_fails_a_request_whose_first_sample_raises(gpt2_vocab_export, monkeypatch):
    """A sampling error at the end of a prompt's prefill is answered (500), not left to time out."""
    from gpt2lab.serve import batch
    from gpt2lab.serve.limits import Limits

    def broken(*a, **k):
        raise RuntimeError("sampling broke")

    monkeypatch.setattr(batch, "sample_next", broken)
    _, d = gpt2_vocab_export
    with running_server([f"tiny={d}"], limits=Limits(timeout_s=20)) as url:
        r = post(url, {"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 500 and "sampling broke" in r.json()["error"]["message"]


@pytest.mark.parametrize("flag,value", [("--temperature", "1e-45"), ("--temperature", "1e-320"),
                                        ("--top-p", "1e-320")])
def test_sample_with_tiny_temperature_or_top_p_prints_the_greedy_text(gpt2_vocab_export, capsys, flag, value):
    _, d = gpt2_vocab_export
    argv = ["sample", "--model", d, "--prompt", "The sea", "--device", "cpu", "--dtype", "float32",
            "--max-new-tokens", "6", "--top-k", "0"]
    assert cli.main(argv + ["--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    assert cli.main(argv + [flag, value]) == 0
    assert capsys.readouterr().out == greedy


def test_port_in_use_is_one_line_and_exit_2(gpt2_vocab_export, capsys):
    import socket

    _, d = gpt2_vocab_export
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        assert cli.main(["serve", "--model", d, "--device", "cpu", "--port", str(port)]) == 2
    finally:
        holder.close()
    assert capsys.readouterr().err.splitlines() == [
        f"gpt2lab serve: --port {port} on 127.0.0.1 is in use (another server?); stop it or pick another --port"]


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_port_out_of_range_is_one_line_and_exit_2(gpt2_vocab_export, capsys, port):
    _, d = gpt2_vocab_export
    assert cli.main(["serve", "--model", d, "--device", "cpu", "--port", port]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"gpt2lab serve: --port {port}: must be 0 to 65535 (0 lets the system pick a free one)"]


def test_a_precision_the_device_cannot_run_is_one_line_and_exit_2_before_loading(capsys):
    # no such model: the flag is refused first, so the model is never looked for
    assert cli.main(["serve", "--model", "no/such/dir", "--device", "cpu", "--port", "0", "--dtype", "float16"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("gpt2lab serve: --dtype float16 needs a GPU")


def test_bench_serve_refuses_a_zero_batch_in_one_line(capsys):
    """Limits checks its own values, so every caller gets the check (a zero --max-batch would
    leave every request waiting for a row until its timeout)."""
    assert cli.main(["bench", "serve", "--n-layer", "1", "--n-head", "1", "--n-embd", "8", "--block-size", "8",
                     "--streams", "", "--max-batch", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("--max-batch 0: must be at least 1")


# --- hostile and odd requests: each answered by one rule, in both server modes

def chat(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", content=json.dumps({"model": "tiny", **body}).encode(),
                      headers={"Content-Type": "application/json"}, timeout=60)  # json.dumps keeps \ud800 escaped


def test_a_lone_surrogate_reads_as_the_tokenizer_reads_it_on_every_path(server):
    """"\\ud800" is valid JSON but no UTF-8 character: the GPT-2 tokenizer reads it as U+FFFD, so the
    server does too, echoed or not, streamed or not, in a prompt, a chat message and a stop string."""
    url, _ = server
    enc = get_tokenizer()
    assert enc.encode("a\ud800b") == enc.encode("a\ufffdb")  # the reference: the tokenizer's own reading
    body = {"model": "tiny", "prompt": "a\ud800b", "echo": True, "max_tokens": 4, "seed": 7}
    whole = post(url, body)
    assert whole.status_code == 200, whole.text
    same = post(url, {**body, "prompt": "a\ufffdb"}).json()
    assert whole.json()["choices"] == same["choices"] and same["choices"][0]["text"].startswith("a\ufffdb")
    with httpx.stream("POST", url + "/v1/completions", content=json.dumps({**body, "stream": True}).encode(),
                      headers={"Content-Type": "application/json"}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == same["choices"][0]["text"]
    messages = [{"role": "user", "content": "a\ud800b"}]
    lone = chat(url, {"messages": messages, "max_tokens": 4, "seed": 7, "stop": "\ud800"})
    fffd = chat(url, {"messages": [{"role": "user", "content": "a\ufffdb"}], "max_tokens": 4, "seed": 7,
                      "stop": "\ufffd"})
    assert lone.status_code == 200 and lone.json()["choices"] == fffd.json()["choices"]
    assert lone.json()["usage"] == fffd.json()["usage"]


def test_sample_prints_a_lone_surrogate_as_the_tokenizer_reads_it(gpt2_vocab_export, capsys):
    """An undecodable byte of a command line (Python's surrogate escape "\\udcff") is U+FFFD in the
    printed prompt, as in the server's echo; the continuation is the one of that text."""
    _, d = gpt2_vocab_export
    argv = ["sample", "--model", d, "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "5"]
    assert cli.main(argv + ["--prompt", "a\udcffb"]) == 0
    lone = capsys.readouterr().out
    assert cli.main(argv + ["--prompt", "a\ufffdb"]) == 0
    assert lone == capsys.readouterr().out and "a\ufffdb" in lone


def test_a_body_that_is_not_utf8_is_named_as_such(server):
    url, _ = server
    body = b'{"model": "tiny", "prompt": "caf\xe9"}'  # Latin-1
    r = post(url, body)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "not UTF-8" in msg and f"byte 0xe9 at position {body.index(0xe9)}" in msg


def test_a_chat_message_may_carry_a_name_and_an_unknown_key_is_named_with_its_place(server):
    url, _ = server
    named = chat(url, {"messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hi", "name": "ann"}], "max_tokens": 3, "seed": 1})
    plain = chat(url, {"messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hi"}], "max_tokens": 3, "seed": 1})
    assert named.status_code == 200 and named.json()["choices"] == plain.json()["choices"]  # not in the template
    r = chat(url, {"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "x", "foo": 1}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"] == "unrecognized request argument: messages[1].foo" and err["param"] == "messages[1].foo"


@pytest.mark.parametrize("path,field,value", [
    ("completions", "max_tokens", True), ("completions", "n", True), ("completions", "seed", False),
    ("completions", "top_k", True), ("completions", "logprobs", True), ("completions", "prompt", [True, False]),
    ("completions", "prompt", [[1, True]]), ("completions", "stream", 1),
    ("chat/completions", "max_tokens", True), ("chat/completions", "max_completion_tokens", True),
    ("chat/completions", "n", True)])
def test_booleans_are_not_integers_nor_integers_booleans(server, path, field, value):
    url, _ = server
    body = {"model": "tiny", "prompt": "x"} if path == "completions" else {
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    r = httpx.post(f"{url}/v1/{path}", json={**body, field: value}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(f"{field}: ") and f"(got {value!r})" in err["message"]


def test_response_format_text_is_accepted_and_other_formats_are_refused(server):
    url, _ = server
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "seed": 2}
    text = chat(url, {**body, "response_format": {"type": "text"}})
    assert text.status_code == 200 and text.json()["choices"] == chat(url, body).json()["choices"]
    for kind in ("json_object", "json_schema"):
        r = chat(url, {**body, "response_format": {"type": kind}})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "response_format" and "only" in err["message"]
        assert kind in err["message"]


@pytest.mark.parametrize("prompt,where,bad,position", [([-1, 5], "prompt", -1, 0),
                                                        ([[5], [3, 50257]], "prompt[1]", 50257, 1)])
def test_a_token_id_out_of_range_names_the_prompt_and_the_range(server, prompt, where, bad, position):
    url, _ = server
    r = post(url, {"model": "tiny", "prompt": prompt})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt"
    assert err["message"] == (f"{where}: token id {bad} at position {position} is out of range: this model's token "
                              "ids are 0 to 50256")


def test_a_context_error_says_what_the_request_asked(server):
    """No max_tokens sent: chat's default is what the context leaves, so a conversation that fills the
    context is too long by itself; a completion's default is 16, and the message says it is the default."""
    url, _ = server
    enc = get_tokenizer()
    content = "word " * 130
    n = len(enc.encode(f"User: {content}\nAssistant:"))  # inference/chat.py's plain template, written out by hand
    r = chat(url, {"messages": [{"role": "user", "content": content}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert err["message"] == (f"This model's maximum context length is 128 tokens, and the messages alone take {n} "
                              "tokens (as the chat template writes them). Shorten the messages.")
    prompt = "word " * 119
    m = len(enc.encode(prompt))
    r = post(url, {"model": "tiny", "prompt": prompt})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        f"This model's maximum context length is 128 tokens; you asked for {m + 16} ({m} in the prompt, "
        "max_tokens' default of 16). Shorten the prompt or lower max_tokens.")
