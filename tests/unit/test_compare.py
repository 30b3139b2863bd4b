"""gpt2lab compare on hand-made run directories: tokens and seconds to a loss, worked out by hand."""

from __future__ import annotations

import json

import pytest

from gpt2lab.cli import main
from gpt2lab.observe.compare import compare_runs, load_curve

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(path, *, tokens_per_step, dt_ms, val, steps, resumed_from=None):
    """A run of ``steps`` steps, each ``dt_ms`` long, with val losses {step: loss}."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(
        json.dumps({"format_version": 2, "batch": {"total_batch_tokens": tokens_per_step}, "model": {}})
    )
    recs = []
    for s in range(steps):
        if s in val:
            recs.append({"step": s, "val_loss": val[s]})
        recs.append({"step": s, "train_loss": 10.0 - s / 10, "dt_ms": dt_ms, "tokens": (s + 1) * tokens_per_step})
    if steps in val:
        recs.append({"step": steps, "val_loss": val[steps]})
    if resumed_from is not None:  # a resumed run logs the steps after its checkpoint again
        recs += [
            {"step": s, "train_loss": 10.0 - s / 10, "dt_ms": dt_ms, "tokens": (s + 1) * tokens_per_step}
            for s in range(resumed_from, steps)
        ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@pytest.fixture
def runs(tmp_path):
    # baseline: 40 steps of 1000 tokens at 500 ms; val every 10 steps, final 6.0
    base = make_run(
        tmp_path / "faithful",
        tokens_per_step=1000,
        dt_ms=500.0,
        steps=40,
        val={0: 11.0, 10: 8.0, 20: 7.0, 30: 6.5, 40: 6.0},
        resumed_from=25,
    )
    # fast: 20 steps of 1000 tokens at 600 ms; below 6.0 first at step 15
    fast = make_run(
        tmp_path / "fast", tokens_per_step=1000, dt_ms=600.0, steps=20, val={0: 11.0, 5: 7.5, 10: 6.4, 15: 5.9, 20: 5.7}
    )
    return base, fast


def test_tokens_per_step_from_config_json(tmp_path):
    """An eval-only log: a val point's tokens are its step times config.json's total_batch_tokens."""
    from gpt2lab.system.errors import ConfigError

    (tmp_path / "metrics.jsonl").write_text('{"step": 5, "val_loss": 3.0}\n')
    (tmp_path / "config.json").write_text(
        json.dumps({"format_version": 2, "batch": {"total_batch_tokens": 768}, "model": {}})
    )
    assert load_curve(str(tmp_path)).points == [(5, 5 * 768, 0.0, 3.0)]
    (tmp_path / "config.json").write_text(json.dumps({"total_batch_tokens": 512, "n_layer": 2}))  # the first runs'
    with pytest.raises(ConfigError, match="config.json: a run config without format_version, written by an older"):
        load_curve(str(tmp_path))
    (tmp_path / "config.json").unlink()
    assert load_curve(str(tmp_path)).points == [(5, 0, 0.0, 3.0)]  # no config: no tokens known


def test_curve_points_count_tokens_and_seconds_before_each_eval(runs):
    base, fast = runs
    c = load_curve(str(base))
    # val at step s = after s steps: s * 1000 tokens and s * 0.5 s (the resumed steps 25..39 count once)
    assert c.points == [
        (0, 0, 0.0, 11.0),
        (10, 10000, 5.0, 8.0),
        (20, 20000, 10.0, 7.0),
        (30, 30000, 15.0, 6.5),
        (40, 40000, 20.0, 6.0),
    ]
    assert load_curve(str(fast)).reach(6.0) == (15, 15000, pytest.approx(9.0), 5.9)
    assert load_curve(str(fast)).reach(5.0) is None


def test_table_default_target_is_the_first_runs_final_loss(runs, tmp_path):
    base, fast = runs
    out = tmp_path / "cmp.png"
    table = compare_runs([str(base), str(fast)], str(out))
    assert out.read_bytes()[:8] == PNG_MAGIC
    lines = table.splitlines()
    assert lines[0].startswith("val_loss target 6.0000")
    assert "| faithful | 6.0000 | 40 | 40,000 | 20.0 | 40 | 40,000 | 20.0 | 1.00x | 1.00x |" in lines
    # 15,000 / 40,000 tokens = 0.375x; 9.0 / 20.0 seconds = 0.45x
    assert "| fast | 5.7000 | 20 | 20,000 | 12.0 | 15 | 15,000 | 9.0 | 0.38x | 0.45x |" in lines


def test_explicit_target_and_a_run_that_never_reaches_it(runs):
    base, fast = runs
    table = compare_runs([str(fast), str(base)], None, target=5.8)
    assert "| fast | 5.7000 | 20 | 20,000 | 12.0 | 20 | 20,000 | 12.0 | 1.00x | 1.00x |" in table
    assert "| faithful | 6.0000 | 40 | 40,000 | 20.0 | not reached | - | - | - | - |" in table


def test_cli_prints_the_table_and_refuses_one_run(runs, tmp_path, capsys):
    base, fast = runs
    assert main(["compare", str(base), str(fast), "--loss", "7.0", "--out", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert "| fast | 5.7000 | 20 | 20,000 | 12.0 | 10 | 10,000 | 6.0 | 0.50x | 0.60x |" in out
    assert f"wrote {tmp_path / 'c.png'}" in out
    assert main(["compare", str(base)]) == 2
    assert "two or more run directories" in capsys.readouterr().err
    assert main(["compare", str(base), str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0] and "metrics.jsonl" in err[0]
