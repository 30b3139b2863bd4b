"""/v1/completions: what the server samples is what `gpt2lab sample` samples (in turns and batched,
seeded or not), streamed token by token or whole, for 8 concurrent clients, cut at stop strings;
``logprobs`` and ``echo`` score text as the model's own log-softmax and loss do; so small a
temperature or top_p that it overflows is greedy, and a lone surrogate reads as the tokenizer reads
it, in the server as in `gpt2lab sample`."""

from __future__ import annotations

import functools
import json
import re
import threading
import time

import pytest
import torch
from conftest import openai_client, post_completion, running_server, scrape

from gpt2lab import cli, get_tokenizer
from gpt2lab.model.sampling import sample_next

openai = pytest.importorskip("openai", reason="the serve tests use the official openai client (test extra)")
httpx = pytest.importorskip("httpx")

# ASCII, a word with an accent, and characters whose bytes are split across tokens
PROMPT = (
    "The quick brown fox jumps over the lazy dog; the café serves tea ☃ and 日本語 to every "
    "guest who asks, twice a day, in the garden by the river."
)


@pytest.fixture(scope="module")
def turns_pair_server(gpt2_vocab_export):
    """--deterministic: requests in turns, each exactly as `gpt2lab sample` runs it."""
    _, d = gpt2_vocab_export
    with running_server([f"tiny={d}", f"twin={d}"], deterministic=True) as url:
        yield url, d


def post_ok(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def sample_cli(capsys, d: str, prompt: str, **flags) -> list[str]:
    """The continuations `gpt2lab sample` prints (prompt and trailing newline removed)."""
    argv = [
        "sample",
        "--model",
        d,
        "--prompt",
        prompt,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--cpu-linear",
        "packed",
    ]
    for k, v in flags.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    assert cli.main(argv) == 0
    parts = re.split(r"--- sample \d+/\d+\n", capsys.readouterr().out)[1:]
    assert all(p.startswith(prompt) and p.endswith("\n") for p in parts)
    return [p[len(prompt) : -1] for p in parts]


@pytest.mark.parametrize("mode", ["pair_server", "turns_pair_server"])
def test_openai_client_completion_equals_gpt2lab_sample(mode, request, capsys):
    url, d = request.getfixturevalue(mode)
    prompt = "The meaning of life is"
    expected = sample_cli(
        capsys, d, prompt, num_samples=2, max_new_tokens=20, seed=7, temperature=0.9, top_k=40, top_p=0.95
    )
    r = openai_client(url).completions.create(
        model="tiny", prompt=prompt, max_tokens=20, seed=7, temperature=0.9, top_p=0.95, n=2, extra_body={"top_k": 40}
    )
    assert [c.text for c in r.choices] == expected
    assert expected[0] != expected[1]  # the two samples continue one generator, as sample's do
    assert [c.index for c in r.choices] == [0, 1] and r.object == "text_completion" and r.model == "tiny"
    n_prompt = len(get_tokenizer().encode(prompt))
    assert r.usage.prompt_tokens == n_prompt and r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    assert {c.finish_reason for c in r.choices} <= {"length", "stop"}
    if r.usage.completion_tokens == 40:  # no <|endoftext|> drawn (the usual case for a random tiny model)
        assert [c.finish_reason for c in r.choices] == ["length", "length"]
    greedy = sample_cli(capsys, d, "", max_new_tokens=12, temperature=0, top_k=0)
    r = openai_client(url).completions.create(model="twin", prompt="", max_tokens=12, temperature=0)
    assert r.choices[0].text == greedy[0] and r.usage.prompt_tokens == 1  # '' is <|endoftext|>, as in sample


@pytest.mark.parametrize("mode", ["pair_server", "turns_pair_server"])
def test_a_seeded_request_with_the_default_settings_gives_samples_default_text(mode, request, capsys):
    """No temperature, top_p or top_k on either side: the API's absent fields are `sample`'s defaults
    (top-k 50), so the texts agree; `--top-k 0` (every token) gives another text, so they would not
    agree if the API's default kept every token."""
    url, d = request.getfixturevalue(mode)
    prompt = "Once upon a time"
    [expected] = sample_cli(capsys, d, prompt, max_new_tokens=24, seed=11)
    r = openai_client(url).completions.create(model="tiny", prompt=prompt, max_tokens=24, seed=11)
    assert r.choices[0].text == expected
    [every] = sample_cli(capsys, d, prompt, max_new_tokens=24, seed=11, top_k=0)
    assert every != expected
    # a field sent as null is its default too, as OpenAI reads null
    nulls = {"temperature": None, "top_p": None, "top_k": None}
    r = openai_client(url).completions.create(model="tiny", prompt=prompt, max_tokens=24, seed=11, extra_body=nulls)
    assert r.choices[0].text == expected


@pytest.mark.slow
def test_with_every_default_flag_sample_and_both_server_modes_hold_one_dtype(
    gpt2_vocab_export, tmp_path, monkeypatch, capsys
):
    """No --dtype or --cpu-linear anywhere (auto: measured, or the device's rule on a busy machine):
    `sample`, the batching server and the --deterministic one hold the model in one dtype, and a
    seeded request in turns, with no sampling settings, gives `sample`'s text."""
    _, d = gpt2_vocab_export
    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path))  # a new machine: the first of them measures
    monkeypatch.delenv("GPT2LAB_PROBE", raising=False)
    prompt = "Once upon a time"
    # Figures taken while the machine was busy are not kept, and a run whose steps ran far slower than its
    # figure drops them (probe.Watch): either way the next run measures again, and may choose otherwise.
    for _ in range(3):
        assert cli.main(["sample", "--model", d, "--device", "cpu", "--prompt", prompt, "--max-new-tokens", "16"]) == 0
        out, err = capsys.readouterr()
        if "the next run measures again" not in err and "those figures are dropped" not in err:
            break  # kept: the servers read this choice
    expected = out.split("--- sample 1/1\n")[1][len(prompt) : -1]
    dtype = re.search(r"gpt2lab sample: dtype (\w+),", err).group(1)
    held = {}
    for mode in ("batched", "turns"):
        with running_server([f"tiny={d}"], deterministic=mode == "turns", linear="auto", dtype="auto") as url:
            [listed] = httpx.get(url + "/v1/models", timeout=60).json()["data"]
            held[mode] = listed["inference"]["dtype"]
            if mode == "turns":
                r = openai_client(url).completions.create(model="tiny", prompt=prompt, max_tokens=16, seed=42)
                assert r.choices[0].text == expected
    assert held == {"batched": dtype, "turns": dtype}


def test_streaming_yields_the_same_text_token_by_token(pair_server):
    url, _ = pair_server
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=16, seed=3, extra_body={"top_k": 50})
    whole = openai_client(url).completions.create(**kw)
    chunks = list(openai_client(url).completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text
    assert len(texts) >= 10  # one chunk per token (a few tokens may only complete a character)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    with httpx.stream("POST", url + "/v1/completions", json={**kw.pop("extra_body"), **kw, "stream": True}) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert resp.headers["content-type"].startswith("text/event-stream") and lines[-1] == "data: [DONE]"


def test_eight_concurrent_clients_each_get_their_own_continuation(pair_server):
    url, _ = pair_server
    jobs = [
        dict(
            model=("tiny", "twin")[i % 2],
            prompt=f"Request number {i} says",
            max_tokens=12,
            seed=100 + i,
            temperature=0.8,
            stream=bool(i % 3 == 0),
        )
        for i in range(8)
    ]

    def run(job: dict) -> str:
        r = openai_client(url).completions.create(**job)
        return "".join(c.choices[0].text for c in r if c.choices) if job["stream"] else r.choices[0].text

    sequential = [run(job) for job in jobs]
    assert len(set(sequential)) == 8
    concurrent: dict[int, str] = {}
    barrier = threading.Barrier(8)

    def worker(i: int) -> None:
        barrier.wait()  # all eight requests in flight together
        concurrent[i] = run(jobs[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [concurrent.get(i) for i in range(8)] == sequential


def test_stop_strings_cut_the_text_in_both_modes(pair_server):
    url, _ = pair_server
    kw = dict(model="tiny", prompt="Hello", max_tokens=24, seed=11)
    full = openai_client(url).completions.create(**kw).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # spans token boundaries in general
    cut = openai_client(url).completions.create(stop=[stop, "never appears \x00"], **kw).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    streamed = openai_client(url).completions.create(stop=stop, stream=True, **kw)
    assert "".join(c.choices[0].text for c in streamed) == cut.text
    echo = openai_client(url).completions.create(echo=True, **kw).choices[0].text
    assert echo == "Hello" + full


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def _beside(url: str, big: dict, small: dict, started=None, answered=None) -> httpx.Response:
    """``big``'s response; ``small`` is sent while ``big`` runs (once ``started()``, default: ``big``'s connection is
    open, or once ``big`` has ended) and must answer as it does alone; ``answered()`` is called when it has."""
    started = started or (lambda: scrape(url)[("gpt2lab_open_connections",)] >= 2)  # big's, and the scrape's
    alone = _post(url, small)
    hostile: list = []
    runs = threading.Thread(target=lambda: hostile.append(_post(url, big)))
    runs.start()
    while runs.is_alive() and not started():
        time.sleep(0.01)
    beside = _post(url, small)
    if answered:
        answered()
    assert beside.json()["choices"] == alone.json()["choices"]
    runs.join(timeout=120)
    assert hostile, "the large request did not end"
    return hostile[0]


SMALL = {"model": "tiny", "prompt": "Hi", "max_tokens": 8, "seed": 1}


def test_a_500_kb_stop_string_stalls_neither_its_request_nor_a_concurrent_one(tiny_server):
    """A stop string of 500,000 characters (the body under the 1 MiB cap) that the first choice's whole text
    begins (held back to the end), in a request of 4 choices: its choices are the texts without the stop, and it
    costs at most twice the CPU time of the request without the stop (this process's CPU time: the server runs
    in it; floored at 0.5 s), so it cannot hold the event loop or the worker for long; a small request sent
    while it runs is answered as alone. CPU time does not grow with the machine's load as wall time does; a
    stop string compared at every length on every token costs seconds a token."""
    url, _ = tiny_server
    big = {"model": "tiny", "prompt": "Hello", "max_tokens": 60, "seed": 4, "n": 4}
    cpu = time.process_time()
    plain = _post(url, big)
    plain_cpu, cpu = time.process_time() - cpu, time.process_time()
    stop = plain.json()["choices"][0]["text"] + "~" * 500_000
    alone = _post(url, {**big, "stop": stop})
    stop_cpu = time.process_time() - cpu
    assert stop_cpu <= 2 * max(plain_cpu, 0.5), (stop_cpu, plain_cpu)
    for answer in (alone, _beside(url, {**big, "stop": stop}, SMALL)):
        assert answer.status_code == 200 and answer.json()["choices"] == plain.json()["choices"]


def test_a_prompt_slow_to_tokenize_does_not_stall_a_concurrent_request(tiny_server, monkeypatch):
    """A prompt of 900,000 letters (refused past the context once tokenized) whose tokenizing is held (the GIL
    released) until a small request sent meanwhile has been answered: the event loop answers it while the
    tokenizing waits. Were the tokenizing on the event loop, nothing would answer the small request, and the
    hold would end by its 30 s timeout instead. Order, not time: the machine's load cannot change it."""
    import gpt2lab.serve.completions as completions

    slow, tokenizing, answered, encode = "a" * 900_000, threading.Event(), threading.Event(), completions.encode_prompt
    released: list[bool] = []

    def held(text, model):
        if text == slow:
            tokenizing.set()
            released.append(answered.wait(30))
        return encode(text, model)

    monkeypatch.setattr(completions, "encode_prompt", held)
    url, _ = tiny_server
    body = {"model": "tiny", "prompt": slow, "max_tokens": 1}
    r = _beside(url, body, SMALL, tokenizing.is_set, answered.set)
    assert released == [True], "the small request was answered only after the tokenizing ended"
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_equal_prompts_without_a_seed_are_sampled_independently(tiny_server):
    url, _ = tiny_server
    r = post_completion(url, {"model": "tiny", "prompt": ["Once", "Once", "Once"], "max_tokens": 8})
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(texts) == 3 and len(set(texts)) == 3, texts  # 8 tokens of a 50257-token vocabulary
    seeded = post_completion(url, {"model": "tiny", "prompt": ["Once", "Once"], "max_tokens": 8, "seed": 5})
    a, b = [c["text"] for c in seeded.json()["choices"]]
    assert a == b  # with a seed each prompt reproduces `sample --seed` (documented in the README)


# --- logprobs and echo


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


def test_echo_with_max_tokens_0_scores_the_prompt_with_the_models_log_softmax(tiny_server):
    url, model = tiny_server
    r = post_ok(
        url, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 5}
    )
    ids = get_tokenizer().encode(PROMPT)
    assert len(ids) > 3 * 7 and any(t.startswith("bytes:") for t in r["choices"][0]["logprobs"]["tokens"])
    choice = r["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    check_logprobs(choice["logprobs"], ids, model, 5)


def test_the_echoed_logprobs_sum_to_minus_the_models_loss(tiny_server):
    """Two token-id prompts in one request (as lm-eval sends them); each one's logprobs add up to
    -(gpt2lab's mean loss x count) from the model's own forward with targets."""
    url, model = tiny_server
    enc = get_tokenizer()
    prompts = [enc.encode(PROMPT), enc.encode("A second, shorter text to score.")]
    r = post_ok(
        url, "/v1/completions", {"model": "tiny", "prompt": prompts, "echo": True, "max_tokens": 0, "logprobs": 0}
    )
    for ids, choice in zip(prompts, r["choices"]):
        idx = torch.tensor([ids])
        with torch.no_grad():
            _, loss = model(idx[:, :-1], targets=idx[:, 1:])
        assert sum(choice["logprobs"]["token_logprobs"][1:]) == pytest.approx(-loss.item() * (len(ids) - 1), rel=1e-6)
        # logprobs 0: no other tokens, only each token itself in its top_logprobs
        assert [list(top) for top in choice["logprobs"]["top_logprobs"][1:]] == [
            [t] for t in choice["logprobs"]["tokens"][1:]
        ]


def test_sampled_tokens_carry_their_logprob_before_temperature_and_top_k(tiny_server):
    """Each sampled token's logprob is the model's unfiltered distribution's (temperature 1.3 and
    top-k 5 change what is drawn, not what is reported); streamed, the chunks' logprobs add up to
    the whole response's."""
    url, model = tiny_server
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "echo": True,
        "max_tokens": 10,
        "logprobs": 3,
        "seed": 4,
        "temperature": 1.3,
        "top_k": 5,
    }
    r = post_ok(url, "/v1/completions", body)
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


def test_logprobs_without_echo_cover_the_completion_only(tiny_server):
    url, model = tiny_server
    r = post_ok(
        url,
        "/v1/completions",
        {"model": "tiny", "prompt": "Hello there", "max_tokens": 4, "logprobs": 1, "seed": 2, "temperature": 0},
    )
    lp = r["choices"][0]["logprobs"]
    ids = get_tokenizer().encode("Hello there")
    new = [token_ids_by_name()[t] for t in lp["tokens"]]
    assert len(new) == 4 and r["choices"][0]["text"] == get_tokenizer().decode(new)
    ref = log_softmax_of(model, ids + new)[len(ids) - 1 :]
    assert new == ref.argmax(-1).tolist()  # greedy
    assert lp["token_logprobs"] == pytest.approx(ref.max(-1).values.tolist(), abs=1e-5)
    assert lp["text_offset"][0] == len("Hello there")  # offsets count from the prompt's start, as OpenAI's


def test_logprobs_of_a_stopped_choice_end_with_the_token_that_completed_the_stop(tiny_server):
    url, _ = tiny_server
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 24, "seed": 11, "logprobs": 0}
    full = post_ok(url, "/v1/completions", body)["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    r = post_ok(url, "/v1/completions", {**body, "stop": stop})
    ids = [token_ids_by_name()[t] for t in r["choices"][0]["logprobs"]["tokens"]]
    assert r["choices"][0]["finish_reason"] == "stop" and len(ids) == r["usage"]["completion_tokens"]
    cut = r["choices"][0]["text"] + stop
    assert get_tokenizer().decode(ids).startswith(cut) and not get_tokenizer().decode(ids[:-1]).startswith(cut)


# --- so small a temperature or top_p that it overflows; a lone surrogate (the server as `gpt2lab sample`)


@pytest.mark.parametrize(
    "field,value", [("temperature", 1e-45), ("temperature", 1e-320), ("top_p", 1e-45), ("top_p", 1e-320)]
)
def test_tiny_temperature_and_top_p_sample_the_greedy_token(tiny_server, field, value):
    """So small a temperature (or top_p) leaves all the mass on the most likely token: greedy's text."""
    url, _ = tiny_server
    body = {"model": "tiny", "prompt": "The sea", "max_tokens": 6, "seed": 3}
    greedy = post_completion(url, {**body, "temperature": 0})
    r = post_completion(url, {**body, field: value})
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


@pytest.mark.parametrize("flag,value", [("--temperature", "1e-45"), ("--temperature", "1e-320"), ("--top-p", "1e-320")])
def test_sample_with_tiny_temperature_or_top_p_prints_the_greedy_text(gpt2_vocab_export, capsys, flag, value):
    _, d = gpt2_vocab_export
    argv = [
        "sample",
        "--model",
        d,
        "--prompt",
        "The sea",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "6",
        "--top-k",
        "0",
    ]
    assert cli.main(argv + ["--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    assert cli.main(argv + [flag, value]) == 0
    assert capsys.readouterr().out == greedy


def test_sample_prints_a_lone_surrogate_as_the_tokenizer_reads_it(gpt2_vocab_export, capsys):
    """An undecodable byte of a command line (Python's surrogate escape "\\udcff") is U+FFFD in the
    printed prompt, as in the server's echo; the continuation is the one of that text."""
    _, d = gpt2_vocab_export
    argv = ["sample", "--model", d, "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "5"]
    assert cli.main(argv + ["--prompt", "a\udcffb"]) == 0
    lone = capsys.readouterr().out
    assert cli.main(argv + ["--prompt", "a\ufffdb"]) == 0
    assert lone == capsys.readouterr().out and "a\ufffdb" in lone
