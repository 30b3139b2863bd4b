"""Poor train/config/eval cases: TOML values of the wrong type, a user's own --config
file, sample/eval flag values (exit 2), eval loss --tokens past the split, a resume with another
--lora-rank, a split smaller than one micro-batch, and a full disk under metrics.jsonl."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections import namedtuple

import pytest
from conftest import cli_args

from gpt2lab import cli


def one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [
        line
        for line in err.strip().splitlines()
        if line.startswith("gpt2lab") and ": dtype " not in line and ": measuring " not in line
    ]
    assert len(lines) == 1, err  # the error (the probe's notice and the dtype choice are info lines before it)
    return lines[0]


def train_argv(data: str, out, *extra: str, **fields) -> list[str]:
    return ["train", "--preset", "shakespeare-cpu", *cli_args(data=data, out=str(out), **fields), *extra]


# -- config files ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "line,key,kind",
    [
        ('max_steps = "ten"', "max_steps", "a whole number"),
        ("max_steps = 2.5", "max_steps", "a whole number"),
        ("max_lr = true", "max_lr", "a number"),
        ('n_layer = "two"', "n_layer", "a whole number"),
        ("compile = 3", "compile", "text"),
        ("max_lr = inf", "max_lr", "a number"),
        ("min_lr = nan", "min_lr", "a number"),
    ],
)
def test_a_wrong_type_in_a_config_file_is_one_line_naming_the_key(tmp_path, capsys, line, key, kind):
    path = tmp_path / "mine.toml"
    path.write_text(f'base = "shakespeare-cpu"\n{line}\n')
    assert cli.main(["train", "--config", str(path), "--out", str(tmp_path / "run")]) == 2
    msg = one_line(capsys.readouterr().err)
    assert str(path) in msg and f"{key} must be {kind}" in msg, msg
    assert not (tmp_path / "run").exists()


def test_a_users_config_file_trains_with_its_values_and_flags_override_it(tiny_data, tmp_path, capsys):
    path = tmp_path / "mine.toml"
    path.write_text(
        'base = "shakespeare-cpu"  # a packaged preset to start from\n'
        "n_layer = 1\nn_head = 2\nn_embd = 32\nblock_size = 32\nseq_len = 32\nmicro_batch_size = 2\n"
        "total_batch_tokens = 64\nmax_steps = 3\nwarmup_steps = 1\n"
        "eval_interval = 0\nsample_interval = 0\nckpt_interval = 0\nprogress = false\n"
        "keep_cpu_memory = false\n[model]\ntie_embeddings = false\n"
    )
    out = tmp_path / "run"
    assert cli.main(["train", "--config", str(path), "--data", tiny_data, "--out", str(out), "--max-steps", "2"]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["optim"]["max_steps"] == 2 and saved["optim"]["warmup_steps"] == 1
    assert saved["batch"]["total_batch_tokens"] == 64
    assert saved["model"]["n_layer"] == 1 and saved["model"]["tie_embeddings"] is False
    assert saved["optim"]["max_lr"] == 1.5e-3  # from the base preset
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "train_loss" in r] == [0, 1]


def test_config_file_problems_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("max_steps = \n")
    assert cli.main(["train", "--config", str(bad)]) == 2
    assert f"{bad}: not valid TOML" in one_line(capsys.readouterr().err)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("max_stepz = 3\n")
    assert cli.main(["train", "--config", str(unknown)]) == 2
    assert "unknown field(s) max_stepz (did you mean max_steps?)" in one_line(capsys.readouterr().err)
    base = tmp_path / "base.toml"
    base.write_text('base = "gpt2-125m"\n')
    assert cli.main(["train", "--config", str(base)]) == 2
    assert "unknown preset 'gpt2-125m'; did you mean gpt2-124m?" in one_line(capsys.readouterr().err)
    assert cli.main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert f"--config {tmp_path / 'missing.toml'}: no such file" in one_line(capsys.readouterr().err)
    with pytest.raises(SystemExit) as e:  # argparse: one of the two, not both
        cli.main(["train", "--config", str(base), "--preset", "shakespeare-cpu"])
    assert e.value.code == 2


# -- sample and eval flags --------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv,flag",
    [
        (["sample", "--num-samples", "0"], "--num-samples 0"),
        (["sample", "--top-p", "1.5"], "--top-p 1.5"),
        (["sample", "--temperature", "-1"], "--temperature -1"),
        (["eval", "loss", "--tokens", "0", "--data", "x"], "--tokens 0"),
        (["eval", "loss", "--batch-size", "-2", "--data", "x"], "--batch-size -2"),
        (["eval", "hellaswag", "--limit", "0"], "--limit 0"),
    ],
)
def test_bad_sample_and_eval_flags_exit_2_naming_the_flag(gpt2_vocab_export, capsys, argv, flag):
    _, d = gpt2_vocab_export
    try:  # a count flag typed for argparse is refused there, the others by the command: exit 2 either way
        code = cli.main([*argv, "--model", d, "--device", "cpu"])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = "\n".join(ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("usage:"))
    line, (name, value) = one_line(err), flag.split()
    assert name in line and value in line.split(name, 1)[1], line


@pytest.mark.parametrize(
    "argv",
    [
        ["sample", "--temperature", "inf"],
        ["sample", "--temperature", "nan"],
        ["sample", "--top-p", "nan"],
        ["sample", "--temperature", "1e999"],
        ["train", "--max-lr", "nan", "--dry-run"],
        ["serve", "--timeout", "-inf"],
        ["compare", "a", "b", "--loss", "nan"],
    ],
)
def test_an_infinite_or_nan_number_flag_is_refused_naming_it(argv, capsys):
    """Every number flag is finite: "inf", "nan" and "1e999" parse as floats and mean no setting."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = one_line(capsys.readouterr().err)
    flag = next(a for a in argv if a.startswith("--") and a != "--dry-run")
    assert f"argument {flag}: expected a finite number, got {argv[argv.index(flag) + 1]!r}" in err


# -- resume ----------------------------------------------------------------------------------
def test_resume_with_another_lora_rank_names_the_flag(gpt2_vocab_export, tiny_data, tmp_path, capsys):
    _, d = gpt2_vocab_export
    out = tmp_path / "lora"
    flags = cli_args(data=tiny_data, out=str(out), max_steps=2, ckpt_interval=2, lora_rank=4, init_from=d)
    pairs = [(k, v) for k, v in zip(flags[::2], flags[1::2]) if k not in ("--n-layer", "--n-head", "--n-embd")]
    argv = ["train", "--preset", "shakespeare-cpu", *[x for pair in pairs for x in pair]]  # the source's shape
    assert cli.main(argv) == 0
    capsys.readouterr()
    again = train_argv(tiny_data, out, "--resume", "auto", max_steps=4, lora_rank=8)
    assert cli.main(again) == 2
    msg = one_line(capsys.readouterr().err)
    assert "--lora-rank 8" in msg and "lora_rank 4" in msg, msg


# -- splits smaller than one micro-batch ---------------------------------------------------------
@pytest.fixture(scope="module")
def small_val(tmp_path_factory) -> str:
    """Tiny Shakespeare with a val split of 100 tokens: 3 sequences of 32."""
    from gpt2lab.data.prepare import prepare

    out = str(tmp_path_factory.mktemp("smallval") / "data")
    prepare("tinyshakespeare", out, val_tokens=100, progress=False)
    return out


def test_a_train_split_smaller_than_one_micro_batch_warns_in_one_line(small_val, tmp_path, capsys):
    # seq_len 32: the 100-token val split holds 3 sequences; swap the splits' roles by training on val
    data = tmp_path / "tiny_train"
    data.mkdir()
    manifest = json.loads(open(os.path.join(small_val, "manifest.json")).read())
    for shard in manifest["shards"]:
        src = os.path.join(small_val, shard["name"])
        name = (
            shard["name"].replace("val_", "train_")
            if shard["split"] == "val"
            else shard["name"].replace("train_", "val_")
        )
        shutil.copy(src, data / name)
        shard["name"], shard["split"] = name, {"val": "train", "train": "val"}[shard["split"]]
    (data / "manifest.json").write_text(json.dumps(manifest))
    argv = train_argv(str(data), tmp_path / "run", max_steps=1, micro_batch_size=4, total_batch_tokens=128)
    assert cli.main(argv) == 0
    warned = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert warned == [
        f"gpt2lab train: warning: the train split of {data} holds 3 sequences of seq_len 32, fewer "
        "than one micro-batch of 4; every batch repeats sequences (lower --micro-batch-size or "
        "prepare more data)"
    ]


def test_a_val_split_smaller_than_one_micro_batch_is_refused_before_training(small_val, tmp_path, capsys):
    argv = train_argv(
        small_val,
        tmp_path / "run",
        max_steps=2,
        micro_batch_size=4,
        total_batch_tokens=128,
        eval_interval=1,
        eval_tokens=128,
    )
    assert cli.main(argv) == 2
    msg = one_line(capsys.readouterr().err)
    assert msg == (
        f"gpt2lab train: the val split of {small_val} holds 3 sequences of seq_len 32, fewer than one "
        "micro-batch of 4, so it cannot give a validation loss; lower --micro-batch-size to 3, "
        "prepare a larger val split (gpt2lab prepare --val-tokens), or set --eval-interval 0"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# -- a full disk under metrics.jsonl --------------------------------------------------------------
def test_disk_full_in_metrics_jsonl_names_it_and_its_own_filesystems_free_space(
    tiny_data, tmp_path, capsys, monkeypatch
):
    from gpt2lab.observe import metrics

    out = tmp_path / "run"
    real_open = open

    class FullDisk:
        """metrics.jsonl on a disk that fills after the first line (every later flush fails)."""

        def __init__(self, fh):
            self.fh, self.lines = fh, 0

        def write(self, text):
            self.lines += 1
            if self.lines > 1:
                self.pending = True
            else:
                self.fh.write(text)

        def flush(self):
            if getattr(self, "pending", False):
                raise OSError(errno.ENOSPC, "No space left on device")
            self.fh.flush()

        def close(self):
            self.fh.close()
            if getattr(self, "pending", False):  # a buffered line is flushed again at close
                raise OSError(errno.ENOSPC, "No space left on device")

    def fake_open(path, *a, **k):
        fh = real_open(path, *a, **k)
        return FullDisk(fh) if str(path).endswith("metrics.jsonl") and a[:1] == ("a",) else fh

    Usage = namedtuple("Usage", "total used free")
    real_usage = shutil.disk_usage
    monkeypatch.setattr(metrics, "open", fake_open, raising=False)
    # the run's filesystem has 3 MiB free, the current directory's another amount
    monkeypatch.setattr(
        shutil, "disk_usage", lambda p: Usage(1, 1, 3 * 2**20) if str(p).startswith(str(tmp_path)) else real_usage(p)
    )
    assert cli.main(train_argv(tiny_data, out, max_steps=3)) == 4
    msg = one_line(capsys.readouterr().err)
    said = json.loads((out / "run_info.json").read_text())["resume_with"]  # the command, as train built it
    assert said.startswith("`") and said.endswith(f" --out {out} --resume auto`")
    assert msg == (
        f"gpt2lab train: disk full while writing {out / 'metrics.jsonl'} (3 MiB free); nothing "
        f"half-written was kept; free some space, then continue with {said}"
    ), msg


# -- what a newcomer sees --------------------------------------------------------------------
@pytest.mark.parametrize("terminal", [False, True])
def test_the_progress_bar_is_drawn_only_on_a_terminal(tiny_data, tmp_path, capsys, monkeypatch, terminal):
    """A redirected stderr (a log file) gets the step lines only, never tqdm's bar among them."""
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    assert cli.main(train_argv(tiny_data, tmp_path / "run", "--max-steps", "2", progress=True)) == 0
    err = capsys.readouterr().err
    assert ("step/s" in err or "s/step" in err) == terminal, err


@pytest.mark.parametrize("preset", ["shakespeare-cpu", "shakespeare-cpu-fast"])
def test_the_demo_presets_draw_a_validation_curve(preset):
    """At least 10 validation losses over the run, not a two-point curve (the start and the end)."""
    from gpt2lab.train.evaluation import due
    from gpt2lab.train.settings import load_preset

    cfg = load_preset(preset)
    steps = cfg.optim.max_steps
    evals = [s for s in range(steps + 1) if due(cfg.eval.eval_interval, s, steps)]
    assert len(evals) >= 10 and evals[0] == 0 and evals[-1] == steps
    assert max(b - a for a, b in zip(evals, evals[1:])) <= steps // 9
