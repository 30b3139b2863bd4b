"""Optional, end to end: EleutherAI's lm-evaluation-harness (its task loader, HF datasets and
transformers, ~15 s of set-up) scores a tiny model like `eval hellaswag`: the exported
directory through its ``hf`` model, and ``gpt2lab serve`` through its ``local-completions``
model (the OpenAI completions API with ``echo`` and ``logprobs``).

Skipped unless ``lm_eval`` is importable. The task is a local copy of the HellaSwag slice
with the reference scoring: context, then " " + ending. The harness's own ``acc_norm``
divides by the ending's length in bytes; ours (the reference recipe's) by its length in
tokens, so the task reports a token-normalised accuracy computed from the harness's
log-likelihoods.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from conftest import DATA, run_gpt2lab

lm_eval = pytest.importorskip("lm_eval")

SLICE = str(DATA / "hellaswag_val_200.jsonl")
N = 20

TASK_YAML = """\
task: gpt2lab_hellaswag_slice
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
output_type: multiple_choice
validation_split: validation
doc_to_text: "{{{{ctx}}}}"
doc_to_target: "{{{{label}}}}"
doc_to_choice: "{{{{endings}}}}"
target_delimiter: " "
process_results: !function gpt2lab_utils.process_results
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm_tokens
    aggregation: mean
    higher_is_better: true
"""

UTILS = """
from gpt2lab.data.tokenizer import gpt2_tokenizer


def process_results(doc, results):
    lls = [r[0] for r in results]
    enc = gpt2_tokenizer()
    per_token = [ll / len(enc.encode(" " + e)) for ll, e in zip(lls, doc["endings"])]
    label = int(doc["label"])
    return {"acc": float(max(range(4), key=lls.__getitem__) == label),
            "acc_norm_tokens": float(max(range(4), key=per_token.__getitem__) == label)}
"""


def _tiny_export(tmp_path):
    """A tiny GPT-2-vocabulary model and its exported HF directory (tokenizer files included)."""
    from gpt2lab.model.gpt import GPT, GPTConfig
    from gpt2lab.weights import export

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=128)).eval()
    with torch.no_grad():
        model.transformer.wte.weight.mul_(25)  # logits far from uniform: no near-ties
    out = str(tmp_path / "export")
    export.save_pretrained(model, out)
    return model, out


def _slice_task(tmp_path, n: int):
    """The first ``n`` examples of the slice as a jsonl, and a TaskManager that knows the task."""
    from lm_eval.tasks import TaskManager

    data = tmp_path / "slice.jsonl"
    data.write_text("".join(open(SLICE, encoding="utf-8").readlines()[:n]))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "gpt2lab_hellaswag_slice.yaml").write_text(TASK_YAML.format(data=data))
    (tasks / "gpt2lab_utils.py").write_text(UTILS)
    return str(data), TaskManager(include_path=str(tasks))


@pytest.mark.slow
def test_lm_eval_matches_gpt2lab_on_hellaswag_slice(tmp_path, monkeypatch):
    from gpt2lab.evals.hellaswag import evaluate_hellaswag, load_examples

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model, export = _tiny_export(tmp_path)
    data, task_manager = _slice_task(tmp_path, N)
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={export},dtype=float32",
        tasks=["gpt2lab_hellaswag_slice"],
        device="cpu",
        batch_size=4,
        task_manager=task_manager,
    )
    theirs = out["results"]["gpt2lab_hellaswag_slice"]
    ours = evaluate_hellaswag(model, data, device="cpu", batch_size=4)
    assert ours["n"] == N == len(load_examples(data))
    assert theirs["acc_norm_tokens,none"] == pytest.approx(ours["acc_norm"])
    assert theirs["acc,none"] == pytest.approx(ours["acc"])


@pytest.mark.slow
def test_lm_eval_local_completions_against_gpt2lab_serve_equals_eval_hellaswag(tmp_path, monkeypatch):
    """lm-eval's ``local-completions`` asks a real `gpt2lab serve` (loopback) for each ending's
    log-likelihood (prompt token ids, echo, logprobs 1, max_tokens 1, several prompts per
    request); its accuracies equal `gpt2lab eval hellaswag`'s on the same examples, fp32 on both
    sides. The tokenizer is the export's own (HF files), so nothing is downloaded."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    _, export = _tiny_export(tmp_path)
    data, task_manager = _slice_task(tmp_path, 16)
    log = open(tmp_path / "serve.log", "w+")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpt2lab",
            "serve",
            "--model",
            f"tiny={export}",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--port",
            "0",
        ],
        stderr=log,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while " at http://" not in (started := (tmp_path / "serve.log").read_text()):
            assert server.poll() is None and time.monotonic() < deadline, started
            time.sleep(0.1)
        url = started.split(" at ")[1].split("/ ")[0]
        out = lm_eval.simple_evaluate(
            model="local-completions",
            tasks=["gpt2lab_hellaswag_slice"],
            batch_size=8,
            task_manager=task_manager,
            model_args=f"base_url={url}/v1/completions,model=tiny,tokenizer_backend=huggingface,"
            f"tokenizer={export},max_retries=1",
        )
        served = (tmp_path / "serve.log").read_text()
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    theirs = out["results"]["gpt2lab_hellaswag_slice"]
    assert served.count('"POST /v1/completions" 200') == 16 * 4 // 8  # every ending scored, 8 per request
    cli = run_gpt2lab("eval", "hellaswag", "--model", export, "--data", data, "--device", "cpu", "--dtype", "float32")
    assert cli.returncode == 0, cli.stderr
    ours = json.loads(cli.stdout.strip().splitlines()[-1])
    assert ours["n"] == 16 and 0 < ours["acc"] < 1
    assert theirs["acc,none"] == pytest.approx(ours["acc"])
    assert theirs["acc_norm_tokens,none"] == pytest.approx(ours["acc_norm"])
