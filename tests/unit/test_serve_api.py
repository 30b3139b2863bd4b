"""gpt2lab serve scores text (``logprobs`` and ``echo`` on /v1/completions, checked against
the model's own log-softmax and loss), chats (/v1/chat/completions through the official openai
client, plain and streaming, stopping at the template's next turn) and answers unknown routes and
wrong methods with OpenAI's error body; in both server modes."""
from __future__ import annotations

import functools
import json

import pytest
import torch

from conftest import tiny_gpt
from gpt2lab import get_tokenizer
from gpt2lab.serve.limits import Limits
from gpt2lab.weights import export
from serve_utils import running_server

openai = pytest.importorskip("openai", reason="the serve tests use the official openai client (test extra)")
httpx = pytest.importorskip("httpx")

# ASCII, a word with an accent, and characters whose bytes are split across tokens
PROMPT = ("The quick brown fox jumps over the lazy dog; the café serves tea ☃ and 日本語 to every "
          "guest who asks, twice a day, in the garden by the river.")


@pytest.fixture(scope="module", params=["batched", "turns"])
def server(request, gpt2_vocab_export):
    """Both workers; the batching one runs prompts 7 tokens per step, so that scoring crosses chunks."""
    model, d = gpt2_vocab_export
    with running_server([f"tiny={d}"], Limits(prefill_chunk=7), deterministic=request.param == "turns") as url:
        yield url, model


@functools.lru_cache(maxsize=None)
def client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@functools.lru_cache(maxsize=1)
def token_ids_by_name() -> dict[str, int]:
    """OpenAI's name of each GPT-2 token (its text, or bytes:\\xNN.. when not whole UTF-8) -> its id."""
    enc = get_tokenizer()
    names = {}
    for t in range(enc.n_vocab):
        raw = enc.decode_single_token_bytes(t)
        try:
            names[raw.decode("utf-8")] = t
        except UnicodeDecodeError:
            names["bytes:" + "".join(f"\\x{b:02x}" for b in raw)] = t
    assert len(names) == enc.n_vocab  # the names tell every token apart
    return names


def log_softmax_of(model, ids: list[int]) -> torch.Tensor:
    """The model's own log-probabilities (T-1, vocab) of what follows each position, fp32, no cache."""
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]))
    return torch.log_softmax(logits[0, :-1].float(), dim=-1)


def check_logprobs(lp: dict, ids: list[int], model, top: int) -> None:
    """``lp`` (a choice's logprobs, echo on) against the model's log-softmax of ``ids``."""
    names = token_ids_by_name()
    assert [names[t] for t in lp["tokens"]] == ids
    ref = log_softmax_of(model, ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts the first token
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:]), want, rtol=0, atol=1e-5)
    best = ref.topk(top, dim=-1)
    for pos, got in enumerate(lp["top_logprobs"][1:]):
        expected = dict(zip(best.indices[pos].tolist(), best.values[pos].tolist()))
        expected.setdefault(ids[pos + 1], float(want[pos]))  # the token itself, as OpenAI adds it
        assert {names[k] for k in got} == set(expected)
        for name, value in got.items():
            assert value == pytest.approx(expected[names[name]], abs=1e-5)
    raw = [get_tokenizer().decode_single_token_bytes(t) for t in ids]
    assert lp["text_offset"] == [len(b"".join(raw[:i]).decode("utf-8", errors="ignore")) for i in range(len(ids))]


def test_echo_with_max_tokens_0_scores_the_prompt_with_the_models_log_softmax(server):
    url, model = server
    r = post(url, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "echo": True, "max_tokens": 0,
                                      "logprobs": 5})
    ids = get_tokenizer().encode(PROMPT)
    assert len(ids) > 3 * 7 and any(t.startswith("bytes:") for t in r["choices"][0]["logprobs"]["tokens"])
    choice = r["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    check_logprobs(choice["logprobs"], ids, model, 5)


def test_the_echoed_logprobs_sum_to_minus_the_models_loss(server):
    """Two token-id prompts in one request (as lm-eval sends them); each one's logprobs add up to
    -(gpt2lab's mean loss x count) from the model's own forward with targets."""
    url, model = server
    enc = get_tokenizer()
    prompts = [enc.encode(PROMPT), enc.encode("A second, shorter text to score.")]
    r = post(url, "/v1/completions", {"model": "tiny", "prompt": prompts, "echo": True, "max_tokens": 0,
                                      "logprobs": 0})
    for ids, choice in zip(prompts, r["choices"]):
        idx = torch.tensor([ids])
        with torch.no_grad():
            _, loss = model(idx[:, :-1], targets=idx[:, 1:])
        assert sum(choice["logprobs"]["token_logprobs"][1:]) == pytest.approx(-loss.item() * (len(ids) - 1), rel=1e-6)
        # logprobs 0: no other tokens, only each token itself in its top_logprobs
        assert [list(top) for top in choice["logprobs"]["top_logprobs"][1:]] == [[t] for t in choice["logprobs"]["tokens"][1:]]


def test_sampled_tokens_carry_their_logprob_before_temperature_and_top_k(server):
    """Each sampled token's logprob is the model's unfiltered distribution's (temperature 1.3 and
    top-k 5 change what is drawn, not what is reported); streamed, the chunks' logprobs add up to
    the whole response's."""
    url, model = server
    body = {"model": "tiny", "prompt": "Once upon a time", "echo": True, "max_tokens": 10, "logprobs": 3,
            "seed": 4, "temperature": 1.3, "top_k": 5}
    r = post(url, "/v1/completions", body)
    choice = r["choices"][0]
    lp = choice["logprobs"]
    ids = [token_ids_by_name()[t] for t in lp["tokens"]]
    n_prompt = len(get_tokenizer().encode("Once upon a time"))
    assert len(ids) == n_prompt + r["usage"]["completion_tokens"] == n_prompt + 10
    check_logprobs(lp, ids, model, 3)
    assert choice["text"] == get_tokenizer().decode(ids)
    ref = log_softmax_of(model, ids)
    for pos in range(n_prompt - 1, len(ids) - 1):  # every draw is among the 5 most likely tokens
        assert ids[pos + 1] in ref[pos].topk(5).indices.tolist()
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    joined = {k: sum((p[k] for p in parts), []) for k in lp}
    assert joined["tokens"] == lp["tokens"] and joined["text_offset"] == lp["text_offset"]
    assert joined["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-6)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]


def test_logprobs_without_echo_cover_the_completion_only(server):
    url, model = server
    r = post(url, "/v1/completions", {"model": "tiny", "prompt": "Hello there", "max_tokens": 4, "logprobs": 1,
                                      "seed": 2, "temperature": 0})
    lp = r["choices"][0]["logprobs"]
    ids = get_tokenizer().encode("Hello there")
    new = [token_ids_by_name()[t] for t in lp["tokens"]]
    assert len(new) == 4 and r["choices"][0]["text"] == get_tokenizer().decode(new)
    ref = log_softmax_of(model, ids + new)[len(ids) - 1:]
    assert new == ref.argmax(-1).tolist()  # greedy
    assert lp["token_logprobs"] == pytest.approx(ref.max(-1).values.tolist(), abs=1e-5)
    assert lp["text_offset"][0] == len("Hello there")  # offsets count from the prompt's start, as OpenAI's


def test_logprobs_of_a_stopped_choice_end_with_the_token_that_completed_the_stop(server):
    url, _ = server
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 24, "seed": 11, "logprobs": 0}
    full = post(url, "/v1/completions", body)["choices"][0]["text"]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    r = post(url, "/v1/completions", {**body, "stop": stop})
    ids = [token_ids_by_name()[t] for t in r["choices"][0]["logprobs"]["tokens"]]
    assert r["choices"][0]["finish_reason"] == "stop" and len(ids) == r["usage"]["completion_tokens"]
    cut = r["choices"][0]["text"] + stop
    assert get_tokenizer().decode(ids).startswith(cut) and not get_tokenizer().decode(ids[:-1]).startswith(cut)


# --- chat

CONVERSATION = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "Hello!"},
                {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": [{"type": "text", "text": "How are "}, {"type": "text", "text": "you?"}]}]
# The plain template of inference/chat.py, written out by hand
RENDERED = "System: You answer briefly.\nUser: Hello!\nAssistant: Hi.\nUser: How are you?\nAssistant:"


def test_chat_through_the_openai_client_continues_the_template(server):
    url, _ = server
    kw = dict(model="tiny", max_tokens=12, seed=5, temperature=0.8)
    whole = client(url).chat.completions.create(messages=CONVERSATION, **kw)
    # the same text through /v1/completions: the rendered prompt, the template's stop string
    plain = client(url).completions.create(prompt=RENDERED, stop="\nUser:", **kw)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == plain.choices[0].text.lstrip()
    assert whole.choices[0].finish_reason == plain.choices[0].finish_reason
    assert whole.usage.prompt_tokens == len(get_tokenizer().encode(RENDERED))
    assert whole.usage.completion_tokens == plain.usage.completion_tokens
    chunks = list(client(url).chat.completions.create(messages=CONVERSATION, stream=True,
                                                      stream_options={"include_usage": True}, **kw))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


@pytest.fixture(scope="module")
def turn_taker(tmp_path_factory):
    """A model that writes only "\\n", "User" and ":" (its final norm gives every position the same
    vector, its head scores those three tokens 20 and the rest 0): it soon starts a user turn."""
    model = tiny_gpt(seed=1, vocab_size=50257, block_size=256, tie_embeddings=False)
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[get_tokenizer().encode("\nUser:"), 0] = 20.0
    d = str(tmp_path_factory.mktemp("turn_taker") / "model")
    export.save_pretrained(model, d)
    return d


@pytest.mark.parametrize("deterministic", [False, True])
def test_chat_stops_where_the_model_starts_the_users_next_turn(turn_taker, deterministic):
    with running_server([f"m={turn_taker}"], deterministic=deterministic) as url:
        kw = dict(model="m", max_tokens=80, seed=3)
        full = client(url).completions.create(prompt=RENDERED, **kw).choices[0].text
        assert "\nUser:" in full.lstrip()  # the model does begin a user turn, after some text
        r = client(url).chat.completions.create(messages=CONVERSATION, **kw)
        assert r.choices[0].message.content == full[:full.index("\nUser:")].lstrip()
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 80
        streamed = client(url).chat.completions.create(messages=CONVERSATION, stream=True, **kw)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == r.choices[0].message.content


@pytest.mark.parametrize("body,needle", [
    ({"messages": []}, "at least one message"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role 'tool'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "only text parts"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs is not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "unrecognized request argument: tools"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 500}, "maximum context length is 128"),
])
def test_bad_chat_requests_get_a_400_with_openais_error(server, body, needle):
    url, _ = server
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_models_say_they_are_not_chat_models(server):
    url, _ = server
    (entry,) = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    assert "not a chat model" in entry["note"]
    # how it is held, as loaded (running_server asks fp32 packed: one candidate, nothing measured)
    assert {k: entry["inference"][k] for k in ("dtype", "kernel", "reason")} == {
        "dtype": "float32", "kernel": "packed", "reason": "asked for"}


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nothing", 404), ("POST", "/v1/engines", 404),
                                                ("GET", "/v1/completions", 405), ("GET", "/v1/chat/completions", 405),
                                                ("DELETE", "/v1/models", 405)])
def test_unknown_routes_and_wrong_methods_answer_openais_error_body(server, method, path, status):
    url, _ = server
    r = httpx.request(method, url + path, timeout=30)
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert f"({method} {path})" in err["message"]
    if status == 405:
        assert ("POST" if "completions" in path else "GET") in r.headers["allow"]
