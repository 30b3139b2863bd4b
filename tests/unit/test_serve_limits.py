"""A server's limits and what it gives back: a full queue is 429 at once, max_tokens past --max-tokens
400, a body past the cap 413, a request past --timeout 504 (whole or streamed, in both modes), and
/metrics and the access log count it all; a client that hangs up, streamed or not, frees its row and
its queue place."""

from __future__ import annotations

import logging
import threading

import pytest
from conftest import running_server, scrape, tiny_gpt, wait_until_idle

from gpt2lab.serve.limits import Limits
from gpt2lab.weights import export

httpx = pytest.importorskip("httpx")


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
        assert all(
            r.json()["error"]["code"] == "queue_full" and "--max-queue 1" in r.json()["error"]["message"] for r in busy
        )
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


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_client_that_hangs_up_on_a_whole_answer_frees_its_row_and_its_queue_place(gpt2_vocab_export, deterministic):
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
