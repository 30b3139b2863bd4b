"""gpt2lab serve through the official openai client and raw HTTP: equal to `gpt2lab sample` (in turns
and batched), streaming, 8 concurrent clients, every kind of bad request answered with a 4xx, the
batched rows' logits against the one-row model, the limits (429, 504, the max_tokens cap), a client
that hangs up, /metrics, the access log, and the bench's fault run."""
from __future__ import annotations

import functools
import logging
import re
import threading

import pytest
import torch

from conftest import tiny_gpt
from gpt2lab import cli, get_tokenizer
from gpt2lab.serve.engine import Job, QueueFull, StopFilter, Worker, Work
from gpt2lab.serve.limits import Limits
from gpt2lab.weights import export
from serve_utils import running_server, scrape, wait_until_idle

openai = pytest.importorskip("openai", reason="the serve tests use the official openai client (test extra)")
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def server(gpt2_vocab_export):
    _, d = gpt2_vocab_export
    with running_server([f"tiny={d}", f"twin={d}"]) as url:
        yield url, d


@pytest.fixture(scope="module")
def turns_server(gpt2_vocab_export):
    """--deterministic: requests in turns, each exactly as `gpt2lab sample` runs it."""
    _, d = gpt2_vocab_export
    with running_server([f"tiny={d}", f"twin={d}"], deterministic=True) as url:
        yield url, d


@functools.lru_cache(maxsize=None)
def client(url: str):  # one client (thread-safe, keeps connections) per server
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def sample_cli(capsys, d: str, prompt: str, **flags) -> list[str]:
    """The continuations `gpt2lab sample` prints (prompt and trailing newline removed)."""
    argv = ["sample", "--model", d, "--prompt", prompt, "--device", "cpu", "--dtype", "float32", "--cpu-linear", "packed"]
    for k, v in flags.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    assert cli.main(argv) == 0
    parts = re.split(r"--- sample \d+/\d+\n", capsys.readouterr().out)[1:]
    assert all(p.startswith(prompt) and p.endswith("\n") for p in parts)
    return [p[len(prompt):-1] for p in parts]


@pytest.mark.parametrize("mode", ["server", "turns_server"])
def test_openai_client_completion_equals_gpt2lab_sample(mode, request, capsys):
    url, d = request.getfixturevalue(mode)
    prompt = "The meaning of life is"
    expected = sample_cli(capsys, d, prompt, num_samples=2, max_new_tokens=20, seed=7, temperature=0.9,
                          top_k=40, top_p=0.95)
    r = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=20, seed=7, temperature=0.9,
                                       top_p=0.95, n=2, extra_body={"top_k": 40})
    assert [c.text for c in r.choices] == expected
    assert expected[0] != expected[1]  # the two samples continue one generator, as sample's do
    assert [c.index for c in r.choices] == [0, 1] and r.object == "text_completion" and r.model == "tiny"
    n_prompt = len(get_tokenizer().encode(prompt))
    assert r.usage.prompt_tokens == n_prompt and r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    assert {c.finish_reason for c in r.choices} <= {"length", "stop"}
    if r.usage.completion_tokens == 40:  # no <|endoftext|> drawn (the usual case for a random tiny model)
        assert [c.finish_reason for c in r.choices] == ["length", "length"]
    greedy = sample_cli(capsys, d, "", max_new_tokens=12, temperature=0, top_k=0)
    r = client(url).completions.create(model="twin", prompt="", max_tokens=12, temperature=0)
    assert r.choices[0].text == greedy[0] and r.usage.prompt_tokens == 1  # '' is <|endoftext|>, as in sample


def test_streaming_yields_the_same_text_token_by_token(server):
    url, _ = server
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=16, seed=3, extra_body={"top_k": 50})
    whole = client(url).completions.create(**kw)
    chunks = list(client(url).completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text
    assert len(texts) >= 10  # one chunk per token (a few tokens may only complete a character)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    with httpx.stream("POST", url + "/v1/completions", json={**kw.pop("extra_body"), **kw, "stream": True}) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert resp.headers["content-type"].startswith("text/event-stream") and lines[-1] == "data: [DONE]"


def test_eight_concurrent_clients_each_get_their_own_continuation(server):
    url, _ = server
    jobs = [dict(model=("tiny", "twin")[i % 2], prompt=f"Request number {i} says", max_tokens=12, seed=100 + i,
                 temperature=0.8, stream=bool(i % 3 == 0)) for i in range(8)]

    def run(job: dict) -> str:
        r = client(url).completions.create(**job)
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


def test_batched_requests_draw_the_tokens_sample_draws(server, gpt2_vocab_export):
    """Item 2's test set: 8 prompts x seeds in flight together (one batch) give the text that
    completion.stream_text (gpt2lab sample's code) gives each alone."""
    from gpt2lab.inference.completion import Sampling, prompt_ids, seeded_generator, stream_text

    url, _ = server
    model, _ = gpt2_vocab_export
    cases = [(f"Prompt {i}: " + "word " * (3 * i), 10 + i, [0.7, 1.0, 1.3][i % 3], [None, 40][i % 2]) for i in range(8)]
    expected = []
    for prompt, seed, temperature, top_k in cases:
        s = Sampling(max_new_tokens=20, temperature=temperature, top_k=top_k)
        expected.append("".join(t for _, t, _ in stream_text(model, prompt_ids(prompt, model.config), s,
                                                           seeded_generator(torch.device("cpu"), seed))))
    got: dict[int, str] = {}
    barrier = threading.Barrier(len(cases))

    def run(i: int) -> None:
        prompt, seed, temperature, top_k = cases[i]
        barrier.wait()
        r = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=20, seed=seed,
                                           temperature=temperature, extra_body={"top_k": top_k})
        got[i] = r.choices[0].text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [got.get(i) for i in range(len(cases))] == expected
    assert len(set(expected)) == len(cases)


MODERN = dict(pos_emb="rotary", norm="rmsnorm", qk_norm=True, mlp_act="relu2", tie_embeddings=False,
              logit_softcap=15.0)


@pytest.mark.parametrize("linear", ["plain", "packed"])
@pytest.mark.parametrize("block", [{}, MODERN], ids=["gpt2", "modern"])
def test_batched_rows_give_the_unbatched_models_logits(block, linear):
    """RowsCache: rows of different lengths joining and leaving; every row's logits equal the
    one-row forward of its whole sequence without a cache (with rotary, each row is turned by
    its own positions), also with the server's packed linears against the plain model."""
    import copy

    from gpt2lab.inference.kernels import packing_available
    from gpt2lab.inference.choice import Candidate
    from gpt2lab.inference.form import hold as apply
    from gpt2lab.serve.batch import RowsCache

    model = tiny_gpt(seed=5, vocab_size=97, block_size=48, **block)
    reference = copy.deepcopy(model)
    if linear == "packed":
        if not packing_available():
            pytest.skip("this torch build has no oneDNN packed linear")
        model = apply(model, Candidate("float32", "packed"), rows=4)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 9, 16)]
    cache = RowsCache(model.config.n_layer, model.config.block_size)

    def join(seq: list[int]) -> None:
        one = model.new_kv_cache(40)
        model(torch.tensor([seq]), kv_cache=one)
        cache.put(len(cache.lengths), one, 4)

    with torch.inference_mode():
        for seq in seqs:
            join(seq)
        for step in range(8):
            if step == 3:  # the first row leaves (the last moves into its slot) and a new one joins
                cache.remove(0)
                seqs[0] = seqs.pop()
                seqs.append(torch.randint(0, 97, (5,), generator=g).tolist())
                join(seqs[-1])
            new = torch.randint(0, 97, (len(seqs), 1), generator=g)
            batched, _ = model(new, kv_cache=cache.view(torch.device("cpu")), last_only=True)
            for i, seq in enumerate(seqs):
                seq.append(int(new[i]))
                alone, _ = reference(torch.tensor([seq]), last_only=True)
                torch.testing.assert_close(batched[i, -1], alone[0, -1], rtol=1e-5, atol=1e-5)
            assert cache.lengths == [len(s) for s in seqs]
        cache.remove(1), cache.remove(1), cache.remove(0)
    assert cache.k[0] is None  # idle: the buffers are given back


def test_stop_strings_cut_the_text_in_both_modes(server):
    url, _ = server
    kw = dict(model="tiny", prompt="Hello", max_tokens=24, seed=11)
    full = client(url).completions.create(**kw).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]  # spans token boundaries in general
    cut = client(url).completions.create(stop=[stop, "never appears \x00"], **kw).choices[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"
    streamed = client(url).completions.create(stop=stop, stream=True, **kw)
    assert "".join(c.choices[0].text for c in streamed) == cut.text
    echo = client(url).completions.create(echo=True, **kw).choices[0].text
    assert echo == "Hello" + full


def test_stop_filter_holds_back_a_possible_start():
    f = StopFilter(["END"])
    assert f.feed("abcE") == ("abc", False)  # "E" may begin "END"
    assert f.feed("N") == ("", False)
    assert f.feed("Dxyz") == ("", True)
    g = StopFilter(["END"])
    assert g.feed("xE") == ("x", False) and g.feed("Q") == ("EQ", False) and g.flush() == ""


@pytest.mark.parametrize("body,status,needle", [
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
])
def test_bad_requests_get_4xx_with_an_openai_error_and_the_server_keeps_serving(server, body, status, needle):
    url, _ = server
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(url + "/v1/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    ok = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_models_list_and_client_errors(server):
    url, _ = server
    c = client(url)
    assert [m.id for m in c.models.list()] == ["tiny", "twin"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.completions.create(model="gpt2-xxl", prompt="x")
    with pytest.raises(openai.BadRequestError, match="context length"):
        c.completions.create(model="tiny", prompt="word " * 120, max_tokens=16)
    page = httpx.get(url + "/", timeout=30)
    assert page.status_code == 200 and "<script>" in page.text and "/v1/completions" in page.text


def test_serve_bad_model_is_one_line(tmp_path, capsys):
    missing = str(tmp_path / "missing")
    assert cli.main(["serve", "--model", missing, "--device", "cpu", "--port", "0"]) == 1
    assert capsys.readouterr().err.strip().startswith(f"gpt2lab serve: --model {missing}: no such directory")
    assert cli.main(["serve", "--model", missing, "--max-queue", "0", "--port", "0"]) == 2  # a UsageError
    assert capsys.readouterr().err.strip().endswith("--max-queue 0: must be at least 1")
    with pytest.raises(SystemExit, match="given twice"):
        cli.main(["serve", "--model", f"a={missing}", "--model", f"a={tmp_path}", "--port", "0"])


def test_limits_queue_full_is_429_the_cap_is_400_and_metrics_count_it_all(gpt2_vocab_export, caplog):
    _, d = gpt2_vocab_export
    limits = Limits(max_batch=1, max_queue=1, max_tokens=100)
    caplog.set_level(logging.INFO, logger="gpt2lab.serve.access")
    with running_server([f"tiny={d}"], limits) as url:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 100, "temperature": 0}
        answers: list = [None] * 6
        barrier = threading.Barrier(6)

        def post(i: int) -> None:
            barrier.wait()  # 1 runs, 1 waits, the rest find the queue full
            answers[i] = httpx.post(url + "/v1/completions", json=body, timeout=60)

        threads = [threading.Thread(target=post, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        ok = [r for r in answers if r.status_code == 200]
        busy = [r for r in answers if r.status_code == 429]
        assert len(ok) + len(busy) == 6 and len(ok) >= 2 and busy, [r.status_code for r in answers]
        assert all(r.json()["error"]["code"] == "queue_full" and "--max-queue 1" in r.json()["error"]["message"]
                   for r in busy)
        assert len({r.json()["choices"][0]["text"] for r in ok}) == 1  # greedy: the same text each time
        capped = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 101}, timeout=30)
        assert capped.status_code == 400 and "--max-tokens" in capped.json()["error"]["message"]
        big = httpx.post(url + "/v1/completions", content=b"x" * ((1 << 20) + 1), timeout=30)
        assert big.status_code == 413 and "at most" in big.json()["error"]["message"]
        m = scrape(url)
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in ok)
    assert m[("gpt2lab_generated_tokens_total", ("model", "tiny"))] == tokens
    assert m[("gpt2lab_requests_total", ("path", "/v1/completions"), ("status", "429"))] == len(busy)
    assert m[("gpt2lab_requests_total", ("path", "/v1/completions"), ("status", "200"))] == len(ok)
    assert m[("gpt2lab_time_to_first_token_seconds_count", ("model", "tiny"))] == len(ok)
    assert m[("gpt2lab_time_per_output_token_seconds_count", ("model", "tiny"))] == tokens - len(ok)
    assert m[("gpt2lab_queue_depth", ("model", "tiny"))] == 0 and m[("gpt2lab_active_rows", ("model", "tiny"))] == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "gpt2lab.serve.access"]
    assert sum('"POST /v1/completions" 429' in line for line in lines) == len(busy)
    assert sum('"POST /v1/completions" 200' in line for line in lines) == len(ok)


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_request_past_the_timeout_gets_504(gpt2_vocab_export, deterministic):
    _, d = gpt2_vocab_export
    with running_server([f"tiny={d}"], Limits(timeout_s=0.02), deterministic) as url:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 120}  # 120 steps: far past 20 ms
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout", r.text
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            lines = [line for line in s.iter_lines() if line]
        assert "took longer than" in lines[-2] and lines[-1] == "data: [DONE]"


def test_a_client_that_hangs_up_frees_its_row(tmp_path):
    d = str(tmp_path / "model")
    export.save_pretrained(tiny_gpt(seed=1, vocab_size=50257, block_size=1024), d)
    with running_server([f"m={d}"]) as url:
        body = {"model": "m", "prompt": "x", "max_tokens": 1000, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as s:
            lines = s.iter_lines()
            next(lines), next(lines)  # two events in: the row is generating
            assert scrape(url)[("gpt2lab_active_rows", ("model", "m"))] == 1
        m = wait_until_idle(url, "m")
        assert 1 <= m[("gpt2lab_generated_tokens_total", ("model", "m"))] < 1000  # it stopped early
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_waiting_client_that_hangs_up_gives_its_queue_place_back_at_once():
    """Its place is free when the handler sees the hang-up, not only at the worker's next step (a
    busy or descheduled worker thread let a request right after it find the queue full: 429)."""
    import asyncio

    from gpt2lab.inference.completion import Sampling

    worker = Worker("m", tiny_gpt(), torch.device("cpu"), Limits(max_batch=1, max_queue=2))  # no engine runs it
    loop = asyncio.new_event_loop()
    try:
        work = Work([[1]], Sampling(max_new_tokens=4), n=1, seeds=[0], stops=[], echo=[])
        first, second = Job(work, loop, 60), Job(work, loop, 60)
        worker.submit(first)
        worker.submit(second)
        with pytest.raises(QueueFull, match="--max-queue 2"):
            worker.submit(Job(work, loop, 60))
        first.cancel()
        assert first.cancelled and worker.queue_depth() == 1
        worker.submit(third := Job(work, loop, 60))  # taken at once: the worker has not stepped
        assert worker.queue_depth() == 2
        first.cancel()  # a second call (the handler's finally after an error) and the worker's own
        worker._started(first)  # drop of the cancelled job give nothing back twice
        assert worker.queue_depth() == 2
        worker._started(third)  # started: its place goes back once, and its later cancel is a no-op
        third.cancel()
        assert worker.queue_depth() == 1
    finally:
        worker.close()
        loop.close()


def test_a_chunked_body_over_the_cap_gets_413_and_the_server_goes_on(server):
    """Without Content-Length (Transfer-Encoding: chunked) the 1 MiB cap holds as the body is read: a
    valid 10 MiB request (its prompt padded with JSON whitespace) is refused, not read and answered."""
    url, _ = server
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
    small = httpx.post(url + "/v1/completions", content=b"".join([head, b" " * 1000, tail]),
                       headers={"Content-Type": "application/json"}, timeout=60)  # the same, under the cap
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 1


# an ASGI request as a client sends a chunked body: no Content-Length to refuse it by
_CHUNKED_POST = {"type": "http", "method": "POST", "path": "/v1/completions", "client": ("127.0.0.1", 1),
                 "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")]}


def test_a_body_that_never_ends_gets_408_after_the_deadline(monkeypatch):
    """At the ASGI level: a client that sends a first piece and then nothing (slow loris) is answered 408
    with OpenAI's error body once the body deadline passes, and the app never sees the request."""
    import asyncio
    import json

    from gpt2lab.serve import api
    from gpt2lab.serve.metrics import ServeMetrics

    monkeypatch.setattr(api, "BODY_TIMEOUT_S", 0.2)
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
    asyncio.run(asyncio.wait_for(api.AccessLog(app, ServeMetrics())(scope, receive, send), 10))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 408
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_timeout"


def test_the_body_cap_stops_reading_once_past_it():
    """At the ASGI level: from an endless chunked body the middleware takes one message past the cap,
    answers 413 with OpenAI's error body, and the app never sees the request."""
    import asyncio
    import json

    from gpt2lab.serve.api import DRAIN_BYTES, MAX_BODY_BYTES, AccessLog
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
    asyncio.run(AccessLog(app, ServeMetrics())(scope, receive, send))
    # the cap, one message past it, then what _drain throws away so the client can read its 413
    assert pulled[0] == (MAX_BODY_BYTES + DRAIN_BYTES) // 65536 + 1
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_client_that_hangs_up_on_a_whole_answer_frees_its_row_and_its_queue_place(gpt2_vocab_export,
                                                                                     deterministic):
    """Not streamed: the server notices the hang-up while the answer is being generated (one row, one
    queue place, each taken by a request of 16 prompts x 16 samples x 120 tokens whose client left)."""
    _, d = gpt2_vocab_export
    with running_server([f"tiny={d}"], Limits(max_batch=1, max_queue=1), deterministic) as url:
        long = {"model": "tiny", "prompt": ["x"] * 16, "n": 16, "max_tokens": 120}
        for _ in range(2):  # the first takes the row, the second the queue place; each client gives up
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/v1/completions", json=long, timeout=httpx.Timeout(60, read=0.5))
        m = wait_until_idle(url, "tiny", timeout=10)
        assert m[("gpt2lab_generated_tokens_total", ("model", "tiny"))] < 16 * 16 * 120
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def _bench(*argv: str) -> dict:
    import argparse

    from gpt2lab.benchmarks import serve as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench.run(parser.parse_args(["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seed", "1",
                                        *argv]))


def test_bench_serve_runs_and_counts_every_token():
    out = _bench("--block-size", "64", "--new-tokens", "6", "--streams", "1,3", "--seconds", "0.5")
    for row, streams in zip(out["load"], (1, 3)):
        assert row["streams"] == streams and row["errors"] == 0 and row["requests"] >= streams
        assert row["tokens"] == 6 * row["requests"]  # seeded: no <|endoftext|> among these draws
        assert row["aggregate_tok_per_s"] == pytest.approx(row["tokens"] / row["wall_s"], rel=0.01)
        assert 0 < row["first_token_s_p50"] <= row["first_token_s_p99"] < row["wall_s"]
        assert 0 < row["token_s_p50"] <= row["token_s_p99"]


def test_bench_serve_fault_run_answers_everything_and_stays_up():
    out = _bench("--block-size", "128", "--new-tokens", "100", "--streams", "", "--max-batch", "2",
                 "--max-queue", "3", "--fault")
    f = out["fault"]
    assert f["rows_left_after_disconnects"] == 0 and f["disconnected"] == 8
    assert (f["malformed_json"], f["oversize_prompt"], f["oversize_body"], f["max_tokens_past_cap"]) == (
        400, 400, 413, 400)
    assert f["burst"] == 13 and f["burst_unanswered"] == 0 and set(f["burst_statuses"]) <= {"200", "429"}
    assert f["burst_statuses"].get("429", 0) >= 1 and f["burst_statuses"].get("200", 0) >= 2
    assert f["still_serving"] == 200
    assert f["rss_after_mb"] - f["rss_before_mb"] < 100  # bounded: no per-request leak
