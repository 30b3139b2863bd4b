"""Optional, end to end: EleutherAI's lm-evaluation-harness (its task loader, HF datasets and
transformers, ~15 s of set-up) scores an exported tiny model like `eval hellaswag`.

Skipped unless ``lm_eval`` is importable. The task is a local copy of the HellaSwag slice
with the reference scoring: context, then " " + ending. The harness's own ``acc_norm``
divides by the ending's length in bytes; ours (the reference recipe's) by its length in
tokens, so the task reports a token-normalised accuracy computed from the harness's
log-likelihoods.
"""
from __future__ import annotations


import pytest
import torch
from conftest import DATA

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

UTILS = '''
from gpt2lab.data.tokenizer import get_tokenizer


def process_results(doc, results):
    lls = [r[0] for r in results]
    enc = get_tokenizer()
    per_token = [ll / len(enc.encode(" " + e)) for ll, e in zip(lls, doc["endings"])]
    label = int(doc["label"])
    return {"acc": float(max(range(4), key=lls.__getitem__) == label),
            "acc_norm_tokens": float(max(range(4), key=per_token.__getitem__) == label)}
'''


def test_lm_eval_matches_gpt2lab_on_hellaswag_slice(tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    from gpt2lab.evals.hellaswag import evaluate_hellaswag, load_examples
    from gpt2lab.model.gpt import GPT, GPTConfig
    from gpt2lab.weights import hf

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=128)).eval()
    with torch.no_grad():
        model.transformer.wte.weight.mul_(25)  # logits far from uniform: no near-ties
    export = str(tmp_path / "export")
    hf.save_pretrained(model, export)
    data = tmp_path / "slice.jsonl"
    data.write_text("".join(open(SLICE, encoding="utf-8").readlines()[:N]))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "gpt2lab_hellaswag_slice.yaml").write_text(TASK_YAML.format(data=data))
    (tasks / "gpt2lab_utils.py").write_text(UTILS)

    out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={export},dtype=float32",
                                  tasks=["gpt2lab_hellaswag_slice"], device="cpu", batch_size=4,
                                  task_manager=TaskManager(include_path=str(tasks)))
    theirs = out["results"]["gpt2lab_hellaswag_slice"]
    ours = evaluate_hellaswag(model, str(data), device="cpu", batch_size=4)
    assert ours["n"] == N == len(load_examples(str(data)))
    assert theirs["acc_norm_tokens,none"] == pytest.approx(ours["acc_norm"])
    assert theirs["acc,none"] == pytest.approx(ours["acc"])
