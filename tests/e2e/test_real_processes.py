"""Tests that need a real process of their own, moved out of the in-process unit lane: two gloo
ranks scoring HellaSwag, a torch.compile'd model (inductor compiles C++ in worker processes),
the CLI's one-line errors and warnings as a console user sees them (stderr of a fresh
interpreter), and modules the CLI imports without torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from conftest import DATA, damaged_copy, env, run_gpt2lab

from gpt2lab.evals.hellaswag import evaluate_hellaswag, load_examples, score_examples

SLICE = str(DATA / "hellaswag_val_200.jsonl")


def _rank_main(rank: int, world: int, store: str, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from gpt2lab.weights.load import load_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        res = evaluate_hellaswag(load_model(model_dir), SLICE, device="cpu", batch_size=4, limit=30)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def test_two_gloo_ranks_equal_one_process(hf_ref, tmp_path):
    from gpt2lab.weights.load import load_model

    _, d = hf_ref
    single = evaluate_hellaswag(load_model(d), SLICE, device="cpu", batch_size=4, limit=30)
    mp.spawn(_rank_main, args=(2, str(tmp_path / "store"), d, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            assert json.load(f) == single
    assert single["n"] == 30 and 0 < single["acc_norm"] < 1


def test_sample_from_the_hub_offline_is_one_line_and_fetches_nothing(tmp_path):
    """No cache, HF_HUB_OFFLINE=1, the endpoint a closed local port: the CLI says to pass a local
    directory, in one line without a traceback (the in-process half: unit/test_hf.py)."""
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"), "HF_ENDPOINT": "http://127.0.0.1:9"}
    cli = run_gpt2lab("sample", "--model", "gpt2-medium", env=env, timeout=60)
    assert cli.returncode != 0
    assert "--model gpt2-medium" in cli.stderr and "local directory" in cli.stderr
    assert "Traceback" not in cli.stderr
    assert not list((tmp_path / "hf_home").rglob("*.safetensors"))


def test_a_truncated_model_file_is_one_line_without_traceback_in_a_real_process(gpt2_vocab_export, tmp_path):
    _, d = gpt2_vocab_export
    bad = damaged_copy(d, str(tmp_path / "model"), "weights")
    r = run_gpt2lab("sample", "--model", str(tmp_path / "model"), "--device", "cpu", "--max-new-tokens", "2")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and bad in r.stderr, r.stderr


def test_warnings_print_as_one_line_with_the_command(tmp_path):
    """plot leaves out an unfinished last line with a warning: one `gpt2lab plot: warning:` line."""
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    path = run / "metrics.jsonl"
    path.write_text('{"step": 0, "train_loss": 2.0}\n{"step": 1, "train_loss": 1.5}\n{"step": 2, "tr')
    r = run_gpt2lab("plot", str(run), "--out", str(tmp_path / "p.png"))
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [f"gpt2lab plot: warning: {path}:3: unfinished last line left out"]


@pytest.mark.parametrize(
    "module",
    ["gpt2lab.model.config", "gpt2lab.model.sampling_defaults", "gpt2lab.train.config", "gpt2lab.system.choices"],
)
def test_config_modules_import_no_torch(module):
    """The CLI builds its flags from these; importing them must not import torch."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_commands_that_need_no_model_import_no_torch(tmp_path):
    """``gpt2lab prepare`` (a whole run of it) and the other commands that read no model parse their flags
    and run without importing torch: the CLI builds only the parser of the command it runs."""
    out = tmp_path / "data"
    prepare = ["prepare", "--source", "tinyshakespeare", "--out", str(out), "--quiet", "--workers", "1"]
    code = (
        "import sys; from gpt2lab import cli\n"
        f"rc = cli.main({prepare!r})\n"
        "for c in ('tokenizer', 'plot', 'compare', 'report', 'export', 'env', 'eval', 'sample', 'train'):\n"
        "    try: cli.main([c, '--help'])\n"
        "    except SystemExit: pass\n"
        "print(rc, 'torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), check=True)
    assert r.stdout.strip().splitlines()[-1] == "0 False", r.stdout + r.stderr
    assert (out / "manifest.json").is_file()


def test_compiled_and_eager_same_predictions(hf_ref):
    from gpt2lab.weights.load import load_model

    _, d = hf_ref
    model = load_model(d)
    examples = load_examples(SLICE, limit=6)
    eager = score_examples(model, examples, device="cpu", batch_size=4)
    compiled = score_examples(torch.compile(model), examples, device="cpu", batch_size=4)
    for e, c in zip(eager, compiled):
        assert (e.pred, e.pred_norm) == (c.pred, c.pred_norm)
        assert c.mean_loss == pytest.approx(e.mean_loss, abs=1e-3)


def test_the_library_generates_in_a_fresh_process_without_writing_or_printing(tmp_path, finished_run):
    """generate() and model.generate(), and for_inference, in a new interpreter with an empty cache
    directory and HOME: the tokens of a plain greedy loop, nothing on stdout or stderr, no file anywhere."""
    import subprocess
    import sys

    cache, home = tmp_path / "cache", tmp_path / "home"
    cache.mkdir()
    home.mkdir()
    script = f"""
import torch, gpt2lab
model = gpt2lab.from_pretrained({str(finished_run)!r})
tok = gpt2lab.get_tokenizer({str(finished_run)!r})
idx = torch.tensor([tok.encode("ROMEO:")])
a = gpt2lab.generate(model, idx, 8, temperature=0.0)
b = model.generate(idx, 8, temperature=0.0)
c = gpt2lab.generate(gpt2lab.for_inference(model), idx, 8, temperature=0.0)
ids = idx
for _ in range(8):
    with torch.no_grad():
        ids = torch.cat([ids, model(ids)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
assert torch.equal(a, ids) and torch.equal(b, ids) and torch.equal(c, ids), (a, b, c, ids)
"""
    env = {**os.environ, "GPT2LAB_CACHE": str(cache), "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    env.pop("GPT2LAB_PROBE", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (proc.stdout, proc.stderr) == ("", "")
    assert list(cache.iterdir()) == [] and list(home.rglob("*")) == []
