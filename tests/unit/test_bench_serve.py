"""`gpt2lab bench serve` (benchmarks/serve.py): the load run counts every token; the fault run answers
every request and the server stays up, its memory bounded; a zero --max-batch is refused in one line."""

from __future__ import annotations

import pytest

from gpt2lab import cli


def _bench(*argv: str) -> dict:
    import argparse

    from gpt2lab.benchmarks import serve as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench.run(parser.parse_args(["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seed", "1", *argv]))


def test_bench_serve_runs_and_counts_every_token():
    out = _bench("--block-size", "64", "--new-tokens", "6", "--streams", "1,3", "--seconds", "0.5")
    for row, streams in zip(out["load"], (1, 3)):
        assert row["streams"] == streams and row["errors"] == 0 and row["requests"] >= streams
        assert row["tokens"] == 6 * row["requests"]  # seeded: no <|endoftext|> among these draws
        assert row["aggregate_tok_per_s"] == pytest.approx(row["tokens"] / row["wall_s"], rel=0.01)
        assert 0 < row["median_ttft_ms"] <= row["p99_ttft_ms"] < 1000 * row["wall_s"]
        assert 0 < row["median_itl_ms"] <= row["p99_itl_ms"] and 0 < row["median_tpot_ms"] <= row["p99_tpot_ms"]
        assert row["median_ttft_ms"] < row["median_e2el_ms"] <= row["p99_e2el_ms"]
        assert row["request_throughput"] == pytest.approx(row["requests"] / row["wall_s"], rel=0.01)


def test_poisson_arrivals_have_the_asked_rate_and_repeat_by_seed():
    from gpt2lab.benchmarks.serve import arrivals

    times = arrivals(rate=50.0, seconds=200.0, seed=3)
    # a Poisson count over 200 s at 50/s: mean 10,000, standard deviation 100; 5 sigma either side
    assert abs(len(times) - 10_000) < 500
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.05)  # exponential gaps of mean 1/rate
    assert times == sorted(times) and times[-1] < 200 and arrivals(50.0, 200.0, seed=3) == times
    assert arrivals(50.0, 200.0, seed=4) != times


def test_latency_figures_are_vllms_definitions():
    """TPOT = (E2EL - TTFT) / (tokens - 1) per request, ITL = every gap, each summarized in ms."""
    from gpt2lab.benchmarks.serve import summarize, table

    done = [
        {"first_s": 0.1, "gaps": [0.02, 0.04], "tokens": 3, "total_s": 0.16, "error": None},
        {"first_s": 0.3, "gaps": [0.05], "tokens": 2, "total_s": 0.35, "error": None},
        {"first_s": None, "gaps": [], "tokens": 0, "total_s": 0.01, "error": "HTTP 429"},
    ]
    out = summarize(done, wall=2.0, streams=2, rate=1.5)
    assert (out["requests"], out["errors"], out["tokens"]) == (3, 1, 5)
    assert out["request_throughput"] == pytest.approx(1.0) and out["aggregate_tok_per_s"] == pytest.approx(2.5)
    assert out["mean_ttft_ms"] == pytest.approx(200) and out["p99_ttft_ms"] == pytest.approx(300)
    assert out["mean_tpot_ms"] == pytest.approx((30 + 50) / 2)  # (0.16-0.1)/2 and (0.35-0.3)/1
    assert out["mean_itl_ms"] == pytest.approx((20 + 40 + 50) / 3) and out["median_itl_ms"] == pytest.approx(40)
    assert out["median_e2el_ms"] == pytest.approx(160)  # the lower middle of two, as _percentile rounds
    assert "| 2 | 1.50 | 3 (1) | 2.5 |" in table([out])


def test_bench_serve_at_a_request_rate_sends_the_poisson_schedule():
    from gpt2lab.benchmarks.serve import arrivals

    out = _bench("--block-size", "64", "--new-tokens", "4", "--streams", "2", "--seconds", "1", "--request-rate", "6")
    row = out["load"][0]
    assert row["request_rate"] == 6 and row["requests"] == len(arrivals(6.0, 1.0, seed=1)) and row["errors"] == 0
    assert row["tokens"] == 4 * row["requests"]


def test_bench_serve_fault_run_answers_everything_and_stays_up():
    out = _bench(
        "--block-size", "128", "--new-tokens", "100", "--streams", "", "--max-batch", "2", "--max-queue", "3", "--fault"
    )
    f = out["fault"]
    assert f["rows_left_after_disconnects"] == 0 and f["disconnected"] == 8
    assert (f["malformed_json"], f["oversize_prompt"], f["oversize_body"], f["max_tokens_past_cap"]) == (
        400,
        400,
        413,
        400,
    )
    assert f["burst"] == 13 and f["burst_unanswered"] == 0 and set(f["burst_statuses"]) <= {"200", "429"}
    assert f["burst_statuses"].get("429", 0) >= 1 and f["burst_statuses"].get("200", 0) >= 2
    assert f["still_serving"] == 200
    assert f["rss_after_mb"] - f["rss_before_mb"] < 100  # bounded: no per-request leak


def test_bench_serve_refuses_a_zero_batch_in_one_line(capsys):
    """Limits checks its own values, so every caller gets the check (a zero --max-batch would
    leave every request waiting for a row until its timeout)."""
    assert (
        cli.main(
            [
                "bench",
                "serve",
                "--n-layer",
                "1",
                "--n-head",
                "1",
                "--n-embd",
                "8",
                "--block-size",
                "8",
                "--streams",
                "",
                "--max-batch",
                "0",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("--max-batch 0: must be at least 1")


@pytest.mark.parametrize(
    "flag, line",
    [(("--request-rate", "0"), "--request-rate 0.0: must be > 0"), (("--streams", "1,x"), "--streams 1,x")],
)
def test_bench_serve_refuses_a_bad_rate_or_count_in_one_line(capsys, flag, line):
    argv = ["bench", "serve", "--n-layer", "1", "--n-head", "1", "--n-embd", "8", "--block-size", "8", *flag]
    assert cli.main(argv) == 2
    assert line in capsys.readouterr().err.strip().splitlines()[-1]
