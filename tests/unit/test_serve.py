"""gpt2lab serve through the official openai client and raw HTTP: equal to `gpt2lab sample`,
streaming, 8 concurrent clients, and every kind of bad request answered with a 4xx."""
from __future__ import annotations

import functools
import re
import threading

import pytest

from gpt2lab import cli, get_tokenizer
from gpt2lab.serve.engine import StopFilter
from serve_utils import running_server

openai = pytest.importorskip("openai", reason="the serve tests use the official openai client (test extra)")
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def server(gpt2_vocab_export):
    _, d = gpt2_vocab_export
    with running_server([f"tiny={d}", f"twin={d}"]) as url:
        yield url, d


@functools.lru_cache(maxsize=None)
def client(url: str):  # one client (thread-safe, keeps connections) per server
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def sample_cli(capsys, d: str, prompt: str, **flags) -> list[str]:
    """The continuations `gpt2lab sample` prints (prompt and trailing newline removed)."""
    argv = ["sample", "--model", d, "--prompt", prompt, "--device", "cpu", "--dtype", "float32"]
    for k, v in flags.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    assert cli.main(argv) == 0
    parts = re.split(r"--- sample \d+/\d+\n", capsys.readouterr().out)[1:]
    assert all(p.startswith(prompt) and p.endswith("\n") for p in parts)
    return [p[len(prompt):-1] for p in parts]


def test_openai_client_completion_equals_gpt2lab_sample(server, capsys):
    url, d = server
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
    ({"model": "tiny", "prompt": [60000]}, 400, "outside the model's vocabulary"),
    ({"model": "tiny", "prompt": "x", "max_new_tokens": 5}, 400, "unrecognized request argument"),
    ({"model": "tiny", "prompt": "x", "logprobs": 2}, 400, "logprobs is not supported"),
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


def test_serve_bad_model_is_one_line(tmp_path):
    missing = str(tmp_path / "missing")
    with pytest.raises(SystemExit) as e:  # cli.main's SystemExit(message): one line on stderr, exit 1
        cli.main(["serve", "--model", missing, "--device", "cpu", "--port", "1"])
    assert f"--model {missing}: no such directory" in str(e.value.code)
    with pytest.raises(SystemExit, match="given twice"):
        cli.main(["serve", "--model", f"a={missing}", "--model", f"a={tmp_path}", "--port", "1"])


def test_bench_serve_runs_and_counts_every_token():
    import argparse

    from gpt2lab.benchmarks import serve as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "64",
                              "--new-tokens", "6", "--streams", "3", "--seed", "1"])
    out = bench.run(args)
    assert out["tokens"] == 18 and out["streams"] == 3  # seeded: no <|endoftext|> among these draws
    assert out["aggregate_tok_per_s"] == pytest.approx(18 / out["wall_s"])
    assert 0 < out["first_token_s_mean"] <= out["first_token_s_max"] < out["wall_s"]
