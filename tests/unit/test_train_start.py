"""A newcomer's `gpt2lab train` start: --dry-run runs every check a real start runs, offline, and says
what is missing with the flag that supplies it; HellaSwag without data fails at once, one download
attempt at most; a start that fails before its first step removes exactly what it wrote; a small
text prepares into data the small presets train and evaluate on (its val split: test_data_val_split.py);
a resume that would change what the run trains is refused naming the fields."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import DATA, cli_args, records

from gpt2lab import cli
from gpt2lab.evals import download
from gpt2lab.evals import hellaswag as hs
from gpt2lab.system import runtime
from gpt2lab.system.errors import ConfigError, GPT2LabError
from gpt2lab.train import memplan
from gpt2lab.train.gather import MachineFacts
from gpt2lab.train.plan import check_memory, make_plan
from gpt2lab.train.settings import load_preset


def one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def _tree(root) -> dict:
    return {os.path.join(d, f): Path(d, f).read_bytes() for d, _, files in os.walk(root) for f in files}


@pytest.fixture
def no_network(tmp_path, monkeypatch):
    """A machine with an empty gpt2lab cache and no network: each download attempt is recorded."""
    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path / "cache"))
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    tries = []

    def urlopen(url, timeout=None):
        tries.append(("url", url, timeout))
        raise urllib.error.URLError(OSError(101, "Network is unreachable"))

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    monkeypatch.setattr(download, "from_hub", lambda ds, dest: tries.append(("hub", dest)))
    return tries


# -- 1. --dry-run: every check, in seconds, no network ---------------------------------------------
def test_a_dry_run_of_the_reference_preset_names_the_missing_data_and_never_downloads(
    no_network, tmp_path, capsys, monkeypatch
):
    (tmp_path / "fresh").mkdir()
    monkeypatch.chdir(tmp_path / "fresh")  # a fresh clone: no data/, no runs/
    assert cli.main(["train", "--preset", "gpt2-124m", "--dry-run"]) == 2
    assert one_line(capsys.readouterr().err) == (
        "gpt2lab train: --data data/fineweb-edu-10b: no such directory; make it with `gpt2lab prepare --source SRC "
        "--out data/fineweb-edu-10b` or pass --data DIR (a directory of token shards)"
    )
    assert no_network == [] and os.listdir(tmp_path / "fresh") == []  # no download tried, nothing written


def test_a_dry_run_notes_hellaswag_to_download_and_offline_refuses_it(
    no_network, tiny_data, tmp_path, capsys, monkeypatch
):
    argv = [
        "train",
        "--preset",
        "shakespeare-cpu",
        *cli_args(data=tiny_data, out=str(tmp_path / "run"), hellaswag_interval=5),
        "--dry-run",
    ]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "the plan (nothing trained, nothing written)" in out
    assert one_line(err).startswith(
        "gpt2lab train: note: HellaSwag's official validation set is not in the cache "
        "yet; a real start downloads it into "
    )
    assert no_network == [] and not (tmp_path / "run").exists()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # where a real start could not download it either
    assert cli.main(argv) == 2
    assert "and HF_HUB_OFFLINE is set; pass --hellaswag-data FILE or set --hellaswag-interval 0" in one_line(
        capsys.readouterr().err
    )
    assert no_network == []


def test_a_real_start_tries_hellaswag_once_and_names_the_train_flag(no_network, tiny_data, tmp_path, capsys):
    out = tmp_path / "fresh" / "a" / "run"
    (tmp_path / "fresh").mkdir()
    argv = ["train", "--preset", "shakespeare-cpu", *cli_args(data=tiny_data, out=str(out), hellaswag_interval=5)]
    assert cli.main(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert (
        line.startswith(
            "gpt2lab train: --hellaswag-interval 5: the official HellaSwag validation set is not in the cache"
        )
        and "Network is unreachable" in line
    ), line
    assert "pass --hellaswag-data FILE" in line and "--data FILE" not in line.replace("--hellaswag-data FILE", "")
    assert [t[0] for t in no_network] == ["url"] and no_network[0][2] == download.DOWNLOAD_TIMEOUT_S  # one try, no hub
    assert os.listdir(tmp_path / "fresh") == []  # the run directory and its parent are gone again


def test_eval_hellaswag_without_data_fails_before_loading_the_model(no_network, capsys, monkeypatch):
    from gpt2lab.weights import load

    monkeypatch.setattr(load, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "hellaswag", "--model", "gpt2", "--device", "cpu"])
    assert "could not be downloaded" in str(e.value.code) and "pass --data FILE" in str(e.value.code)
    assert [t[0] for t in no_network] == ["url"]


def test_an_unreachable_network_is_one_attempt_and_a_missing_file_on_the_server_tries_the_hub(no_network):
    with pytest.raises(RuntimeError, match="pass --hellaswag-data FILE"):
        hs.load_examples(flag="--hellaswag-data")
    assert [t[0] for t in no_network] == ["url"]
    no_network.clear()

    def gone(url, timeout=None):
        no_network.append(("url", url, timeout))
        raise urllib.error.HTTPError(url, 404, "Not Found", {}, None)

    urllib.request.urlopen = gone  # monkeypatched by the fixture: restored after the test
    with pytest.raises(RuntimeError, match="404"):
        hs.load_examples()
    assert [t[0] for t in no_network] == ["url", "hub"]


@pytest.fixture(scope="module")
def short_val(tmp_path_factory) -> str:
    """Tiny Shakespeare with a val split of 20 tokens: shorter than one sequence of 32."""
    from gpt2lab.data.prepare import prepare

    out = str(tmp_path_factory.mktemp("shortval") / "data")
    prepare("tinyshakespeare", out, val_tokens=20, progress=False)
    return out


@pytest.mark.parametrize("dry", [True, False])
def test_data_too_small_is_exit_2_naming_the_flags_in_a_dry_run_too(short_val, tmp_path, capsys, dry):
    argv = [
        "train",
        "--preset",
        "shakespeare-cpu",
        *cli_args(data=short_val, out=str(tmp_path / "run"), eval_interval=5),
        *(["--dry-run"] if dry else []),
    ]
    assert cli.main(argv) == 2
    assert one_line(capsys.readouterr().err) == (
        f"gpt2lab train: the val split of {short_val} holds 20 tokens, too few for one sequence of --seq-len 32 (and "
        "the token after it); prepare a larger val split (gpt2lab prepare --val-tokens) or set --eval-interval 0, or "
        "lower --seq-len"
    )
    assert not (tmp_path / "run").exists()


def test_a_dry_run_refuses_a_val_split_smaller_than_a_micro_batch_as_a_start_does(tiny_data, tmp_path, capsys):
    from gpt2lab.data import TokenLoader

    val = TokenLoader(tiny_data, "val", 1, 32).sequences_per_epoch
    argv = [
        "train",
        "--preset",
        "shakespeare-cpu",
        *cli_args(
            data=tiny_data,
            out=str(tmp_path / "run"),
            eval_interval=5,
            micro_batch_size=val + 1,
            total_batch_tokens=32 * (val + 1),
        ),
        "--dry-run",
    ]
    assert cli.main(argv) == 2
    assert f"holds {val} sequences of seq_len 32, fewer than one micro-batch of {val + 1}" in one_line(
        capsys.readouterr().err
    )


def test_a_run_predicted_past_this_machines_memory_is_refused_naming_a_micro_batch_that_fits(tmp_path):
    cfg = load_preset("gpt2-124m", data="unused", out=str(tmp_path / "r"), hellaswag_interval=0, dtype="float32")
    cpu = runtime.Facts("cpu", "some x86", ("avx2",))

    def need(B: int) -> int:  # memplan's prediction, as the plan makes it (fp32, eager, one process)
        run = cfg.with_values(micro_batch_size=B)
        return memplan.predict(run, dtype="float32", device="cpu", compiled=False, accum=524288 // (B * 1024)).total

    ram = (need(16) + need(32)) // 2  # 16 fits, 32 does not
    with pytest.raises(ConfigError) as e:
        check_memory(make_plan(cfg, MachineFacts(cpu, host_bytes=ram)))
    assert str(e.value).startswith(
        f"--micro-batch-size 64: the run is predicted to need {need(64) / 2**30:.1f} GiB "
        f"per process at its peak (micro-step), more than this machine's {ram / 2**30:.1f} GiB "
        "of RAM; lower --micro-batch-size to 16"
    )
    plan = make_plan(cfg.with_values(micro_batch_size=16), MachineFacts(cpu, host_bytes=ram))  # what it named fits
    check_memory(plan)
    assert plan.memory["total"] == round(need(16) / 2**20, 1)
    check_memory(make_plan(cfg, MachineFacts(cpu)))  # RAM unknown: no refusal


# -- 3. a start that fails before its first step --------------------------------------------------
class Boom(GPT2LabError):
    """An error of ours raised inside the start (as an OOM or a data error would be)."""


@pytest.mark.parametrize("where", ["build", "first step", "out of memory"])
def test_a_start_failing_before_its_first_step_removes_its_new_directory(
    tiny_data, tmp_path, capsys, monkeypatch, where
):
    import torch

    from gpt2lab.train import trainer

    def fail(*a):
        raise (
            torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            if where == "out of memory"
            else Boom("no memory for it")
        )

    if where == "build":  # before config.json
        monkeypatch.setattr(trainer, "build_model", fail)
    else:  # after config.json, run_info.json and metrics.jsonl are written
        monkeypatch.setattr(trainer.Trainer, "train_step", fail)
    out = tmp_path / "new" / "run"
    argv = [
        "train",
        "--preset",
        "shakespeare-cpu",
        *cli_args(data=tiny_data, out=str(out), eval_interval=2, eval_tokens=128, tensorboard=True),
    ]
    if where == "out of memory":
        assert cli.main(argv) == 2
        assert one_line(capsys.readouterr().err) == (
            "gpt2lab train: --micro-batch-size 2: out of memory at step 0 (CUDA out of memory. Tried to allocate "
            "2.00 GiB); lower --micro-batch-size or set --activation-checkpointing true"
        )
    else:
        assert cli.main(argv) == 1
        assert "no memory" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # the run directory and the parent it made are gone


def test_a_failed_start_keeps_what_it_did_not_create(tiny_data, tmp_path, capsys, monkeypatch):
    from gpt2lab.train import trainer

    out = tmp_path / "mine"
    out.mkdir()  # the user's empty directory: it stays, only the start's own files go

    def boom(self):
        (out / "notes.txt").write_text("the user's, written while the run started")
        raise Boom("no memory")

    monkeypatch.setattr(trainer.Trainer, "train_step", boom)
    assert cli.main(["train", "--preset", "shakespeare-cpu", *cli_args(data=tiny_data, out=str(out))]) == 1
    capsys.readouterr()
    assert sorted(os.listdir(out)) == ["notes.txt"]


def test_a_resume_failing_before_its_first_step_changes_nothing_there(tiny_data, tmp_path, capsys, monkeypatch):
    from gpt2lab.train import trainer

    out = tmp_path / "run"
    assert cli.main(["train", "--preset", "shakespeare-cpu", *cli_args(data=tiny_data, out=str(out), max_steps=2)]) == 0
    capsys.readouterr()
    before = {p: b for p, b in _tree(out).items() if not p.endswith(("run_info.json", "config.json", "run.lock"))}
    monkeypatch.setattr(trainer.Trainer, "train_step", lambda self: (_ for _ in ()).throw(Boom("no memory")))
    argv = [
        "train",
        "--preset",
        "shakespeare-cpu",
        *cli_args(data=tiny_data, out=str(out), max_steps=4, tensorboard=True),
        "--resume",
        "auto",
    ]
    assert cli.main(argv) == 1
    capsys.readouterr()
    after = _tree(out)
    assert {p: b for p, b in after.items() if p in before} == before and set(before) <= set(after)
    assert not (out / "tensorboard").exists()  # made by this start: gone again


def test_a_failure_after_the_first_step_keeps_the_run(tiny_data, tmp_path, capsys, monkeypatch):
    from gpt2lab.train import trainer

    real = trainer.Trainer.train_step

    def second_fails(self):
        if self.step == 1:
            raise Boom("no memory")
        return real(self)

    monkeypatch.setattr(trainer.Trainer, "train_step", second_fails)
    out = tmp_path / "run"
    assert cli.main(["train", "--preset", "shakespeare-cpu", *cli_args(data=tiny_data, out=str(out))]) == 1
    capsys.readouterr()
    assert [r["step"] for r in records(out) if "train_loss" in r] == [0]
    assert {"config.json", "run_info.json", "metrics.jsonl"} <= set(os.listdir(out))


# -- 4. a small text of one's own (the small_text fixture: conftest.py) ----------------------------
def test_a_small_presets_run_on_it_trains_and_evaluates_what_val_holds(small_text, tmp_path, capsys):
    from gpt2lab.data import TokenLoader

    out = tmp_path / "run"
    argv = [
        "train",
        "--preset",
        "shakespeare-cpu",
        "--data",
        small_text,
        "--out",
        str(out),
        "--max-steps",
        "1",
        "--progress",
        "false",
        "--sample-interval",
        "0",
        "--dtype",
        "float32",
    ]
    assert cli.main([*argv, "--dry-run"]) == 0
    dry = capsys.readouterr().err
    assert cli.main(argv) == 0
    out_text, err = capsys.readouterr()
    assert out_text.splitlines()[-4:] == [
        f"run dir: {out}",
        f"last checkpoint: {out}/checkpoints/step_000001",
        f"plot: {out}/plot.png",
        f"report: gpt2lab report {out}",
    ]
    val = TokenLoader(small_text, "val", 6, 128).sequences_per_epoch
    whole = val // 6 * 6 * 128
    note = (
        f"gpt2lab train: note: --eval-tokens 13,056 is more than the val split of {small_text} holds; each "
        f"evaluation takes all it holds in whole micro-batches: {whole:,} tokens ({val // 6} of 6 x 128)"
    )
    assert [line for line in err.splitlines() if "note" in line or "warning" in line] == [note]
    assert note in dry.splitlines()  # the dry run says what the start says
    assert [r["step"] for r in records(out) if "val_loss" in r] == [0, 1]


# -- 5. a resume that would change what the run trains --------------------------------------------
MUON = dict(optimizer="muon", muon_variant="normuon", ema_decay=0.9, max_steps=2, ckpt_interval=2)


@pytest.fixture(scope="module")
def muon_run(tiny_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("muon") / "run"
    assert cli.main(["train", "--preset", "shakespeare-cpu", *cli_args(data=tiny_data, out=str(out), **MUON)]) == 0
    return out


@pytest.mark.parametrize(
    "change, line",
    [
        (
            dict(muon_variant="muon"),
            "--muon-variant muon: the checkpoint {ckpt} was trained with muon_variant normuon; "
            "resume with --muon-variant normuon, or start a new run in another --out",
        ),
        (
            dict(ema_decay=0.5),
            "--ema-decay 0.5: the checkpoint {ckpt} was trained with ema_decay 0.9; resume with "
            "--ema-decay 0.9, or start a new run in another --out",
        ),
        (
            dict(ema_decay=0.0, mlp_act="relu2", seed=7),
            "--mlp-act relu2 --seed 7 --ema-decay 0.0: the checkpoint {ckpt} was trained with mlp_act gelu, "
            "seed 1234, ema_decay 0.9; resume with --mlp-act gelu --seed 1234 --ema-decay 0.9, or start a new run "
            "in another --out",
        ),
    ],
)
def test_a_resume_that_changes_what_the_run_trains_is_refused_and_config_json_kept(
    muon_run, tiny_data, capsys, change, line
):
    before = _tree(muon_run)
    del before[str(muon_run / "run.lock")]  # the lock's holder: whoever took it last
    argv = [
        "train",
        "--preset",
        "shakespeare-cpu",
        *cli_args(data=tiny_data, out=str(muon_run), **{**MUON, "max_steps": 4, **change}),
        "--resume",
        "auto",
    ]
    assert cli.main(argv) == 2
    ckpt = muon_run / "checkpoints" / "step_000002"
    assert one_line(capsys.readouterr().err) == "gpt2lab train: " + line.format(ckpt=ckpt)
    after = _tree(muon_run)
    del after[str(muon_run / "run.lock")]
    assert after == before  # config.json (and everything else) as the first part wrote it


def test_a_resume_may_change_what_does_not_change_the_training(muon_run, tiny_data, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(muon_run, run)
    argv = [
        "train",
        "--preset",
        "shakespeare-cpu",
        *cli_args(
            data=tiny_data,
            out=str(run),
            **{
                **MUON,
                "max_steps": 3,
                "eval_interval": 3,
                "eval_tokens": 64,
                "muon_ns_dtype": "float32",
                "micro_batch_size": 4,
            },
        ),
        "--resume",
        "auto",
    ]
    assert cli.main(argv) == 0
    capsys.readouterr()
    saved = json.loads((run / "config.json").read_text())
    assert saved["optim"]["max_steps"] == 3 and saved["batch"]["micro_batch_size"] == 4
    assert saved["optim"]["muon_variant"] == "normuon" and saved["optim"]["ema_decay"] == 0.9


# -- 6. one validation: what a dry run passes, a start does not refuse --------------------------------
@pytest.mark.parametrize(
    "fields, line",
    [
        (dict(log_interval=0), "log_interval 0 must be >= 1"),
        (dict(beta1=1.5), "beta1 1.5 must be in [0, 1)"),
        (dict(beta2=1.0), "beta2 1.0 must be in [0, 1)"),
        (dict(eps=-1), "eps -1.0 must be > 0"),
        (dict(seed=2**32), "seed 4294967296 must be in [0, 4294967295]"),
        (dict(hellaswag_limit=0), "hellaswag_limit 0 must be >= 1"),
        (dict(device="tpu"), "--device tpu: not a device; use cpu, cuda, cuda:N, mps or auto"),
        (dict(device="cuda:99"), "--device cuda:99: this machine has {gpus} cuda device(s); use --device auto"),
        (
            dict(n_layer=3, resume=True),
            "--n-layer 3: the checkpoint {ckpt} was trained with n_layer 2; resume with "
            "--n-layer 2, or start a new run in another --out",
        ),
    ],
)
def test_a_refused_setting_is_the_same_one_line_in_a_dry_run_and_a_start(
    muon_run, tiny_data, tmp_path, capsys, fields, line
):
    """Every setting is checked by the same code before either (its range, the device, what a resume must
    keep): exit 2 and the same line in both, nothing written (a resumed run's directory: not a byte)."""
    import torch

    resume = fields.pop("resume", False)
    out = muon_run if resume else tmp_path / "run"

    def files() -> dict:
        tree = _tree(out)
        tree.pop(str(out / "run.lock"), None)  # its holder: whoever took it last
        return tree

    before = files()
    argv = ["train", "--preset", "shakespeare-cpu", *cli_args(data=tiny_data, out=str(out), **{**MUON, **fields})]
    said = []
    for dry in (["--dry-run"], []):
        assert cli.main(argv + (["--resume", "auto"] if resume else []) + dry) == 2
        said.append(one_line(capsys.readouterr().err))
        assert files() == before and out.exists() == resume
    ckpt = muon_run / "checkpoints" / "step_000002"
    assert said == 2 * ["gpt2lab train: " + line.format(gpus=torch.cuda.device_count(), ckpt=ckpt)]


def test_every_number_setting_declares_its_range_and_a_value_past_it_is_refused():
    """A sweep over every number field of a run's settings (the architecture's too): each declares its
    range (``within``), and the value just past either end is refused naming the field and the value."""
    import dataclasses
    from typing import get_type_hints

    from gpt2lab.model.config import field_type
    from gpt2lab.train.config import SECTIONS, TrainConfig

    for owner in [TrainConfig, *SECTIONS.values()]:
        hints = get_type_hints(owner)
        for f in dataclasses.fields(owner):
            tp, _ = field_type(hints[f.name])
            if tp not in (int, float):
                continue
            within = f.metadata.get("within")
            assert within, f"{owner.__name__}.{f.name} declares no range"
            low, high = within[1:-1].split(", ")
            past = [tp(float(low)) - (within[0] == "[")]
            past += [] if high == "inf" else [tp(float(high)) + (within[-1] == "]")]
            for value in past:
                with pytest.raises(ConfigError, match=f"{f.name} {value} must be "):
                    TrainConfig.from_dict({f.name: value})


def test_a_checkpoint_written_before_a_field_existed_resumes_with_its_default(tmp_path):
    from gpt2lab.train.plan import check_resume_settings

    cfg = load_preset("shakespeare-cpu", data="unused", out=str(tmp_path))
    old = cfg.to_dict()
    del old["optim"]["ema_decay"], old["optim"]["muon_variant"]  # as a version before them wrote it
    check_resume_settings(cfg, old, "step_000002")  # their defaults: what that version trained with
    with pytest.raises(ConfigError, match="--ema-decay 0.5: the checkpoint step_000002 was trained with ema_decay 0.0"):
        check_resume_settings(cfg.with_values(ema_decay=0.5), old, "step_000002")


def test_hellaswag_slice_is_still_accepted_by_a_dry_run(tiny_data, tmp_path, capsys, no_network):
    argv = [
        "train",
        "--preset",
        "shakespeare-cpu",
        *cli_args(
            data=tiny_data,
            out=str(tmp_path / "run"),
            hellaswag_interval=5,
            hellaswag_data=str(DATA / "hellaswag_val_200.jsonl"),
        ),
        "--dry-run",
    ]
    assert cli.main(argv) == 0
    assert capsys.readouterr().err == "" and no_network == []
