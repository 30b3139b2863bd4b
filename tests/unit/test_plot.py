"""Plots and summaries from run dirs made here with synthetic metrics.jsonl / config.json."""

from __future__ import annotations

import json
import math

import pytest

from gpt2lab.cli import main
from gpt2lab.observe.plot import build_figure, detect_size, load_run, plot_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(path, *, n_layer=12, n_embd=768, hellaswag=True, steps=50):
    path.mkdir(parents=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "format_version": 2,
                "data": "data/fineweb-edu-10b",  # no manifest there: the directory's name says the corpus
                "model": {"n_layer": n_layer, "n_head": 12, "n_embd": n_embd},
            }
        )
    )
    lines, val, hs = [], {}, {}
    for s in range(steps):
        lines.append(
            {
                "step": s,
                "train_loss": 11 * math.exp(-s / 20) + 3,
                "lr": 6e-4,
                "grad_norm": 1.0,
                "dt_ms": 10.0,
                "tok_per_s": 1e5,
                "mfu": 0.4,
            }
        )
        if s % 10 == 0:
            val[s] = 10 * math.exp(-s / 25) + 3.1 + (2.0 if s == 40 else 0)  # best is at step 30
            lines.append({"step": s, "val_loss": val[s]})
            if hellaswag:
                hs[s] = 0.25 + s / 1000 - (0.02 if s == 40 else 0)  # best at 30
                lines.append(
                    {"step": s, "hellaswag_acc": hs[s] - 0.01, "hellaswag_acc_norm": hs[s], "hellaswag_n": 10042}
                )
            lines.append({"step": s, "sample": "Hello, I'm a language model,"})
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return val, hs


def _labels(ax):
    return ax.get_legend_handles_labels()[1]


def test_png_from_run_dir_with_baselines(tmp_path):
    make_run(tmp_path / "run")
    out = tmp_path / "run" / "plot.png"
    assert plot_runs([str(tmp_path / "run")], str(out)) is None
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert not list(tmp_path.glob("run/.*tmp"))  # the temporary name is gone
    ax_loss, ax_hs = build_figure([load_run(str(tmp_path / "run"))]).axes
    assert ax_loss.get_yscale() == "log"
    assert {"run train loss", "run val loss"} <= set(_labels(ax_loss))
    hlines = {tuple(line.get_ydata()) for line in ax_loss.lines + ax_hs.lines if len(set(line.get_ydata())) == 1}
    assert {(3.2924, 3.2924), (0.2955, 0.2955), (0.337, 0.337)} <= hlines
    val_line = next(line for line in ax_loss.lines if line.get_label() == "run val loss")
    assert list(val_line.get_xdata()) == [0, 10, 20, 30, 40]


def test_run_without_hellaswag_still_plots_losses(tmp_path):
    make_run(tmp_path / "r", hellaswag=False)
    plot_runs([str(tmp_path / "r")], str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC
    (ax_loss,) = build_figure([load_run(str(tmp_path / "r"))]).axes  # no HellaSwag panel
    assert "r val loss" in _labels(ax_loss) and not any("acc_norm" in x for x in _labels(ax_loss))


def test_several_runs_overlay_with_their_size_baselines(tmp_path):
    make_run(tmp_path / "small")
    make_run(tmp_path / "medium", n_layer=24, n_embd=1024)
    runs = [load_run(str(tmp_path / d)) for d in ("small", "medium")]
    ax_loss, ax_hs = build_figure(runs).axes
    labels = _labels(ax_hs)
    assert {"small acc_norm", "medium acc_norm"} <= set(labels)
    assert "OpenAI GPT-2 (350M) 0.375" in labels and "OpenAI GPT-3 (350M) 0.436" in labels
    assert "OpenAI GPT-2 (124M) 0.2955" in labels


def test_summary_table_best_values(tmp_path, capsys):
    val, hs = make_run(tmp_path / "a")
    make_run(tmp_path / "b", n_layer=2, n_embd=64, hellaswag=False)
    rc = main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "x.png"), "--summary"])
    assert rc == 0
    out = capsys.readouterr().out
    best_val = min(val, key=val.get)
    best_hs = max(hs, key=hs.get)
    assert best_val == 30 and best_hs == 30
    assert f"| a | 124M | 49 | {val[30]:.4f} (step 30) | {hs[30]:.4f} (step 30) |" in out
    assert "| b | - | 49 |" in out and out.rstrip().endswith(f"wrote {tmp_path / 'x.png'}")


def test_size_detection():
    assert detect_size({"model": {"n_layer": 36, "n_embd": 1280}}) == "774M"
    assert detect_size({"model": {"n_layer": 2, "n_embd": 64}}) is None
    assert detect_size({"n_layer": 36, "n_embd": 1280}) is None  # the architecture is read from its section only


def test_bad_run_dirs(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        load_run(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train_loss": 3}\n{"step": 2, "train\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: not valid JSON"):
        load_run(str(tmp_path))
    # A run killed mid-write leaves an unfinished last line: warned about, not fatal.
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train_loss": 3.5}\n{"step": 2, "tra')
    with pytest.warns(UserWarning, match=":2: unfinished last line"):
        run = load_run(str(tmp_path))
    assert run.series["train_loss"] == [(1, 3.5)]
    assert main(["plot", str(tmp_path), str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "gpt2lab plot: several runs need --out FILE.png"
