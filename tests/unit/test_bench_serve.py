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
        assert 0 < row["first_token_s_p50"] <= row["first_token_s_p99"] < row["wall_s"]
        assert 0 < row["token_s_p50"] <= row["token_s_p99"]


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
