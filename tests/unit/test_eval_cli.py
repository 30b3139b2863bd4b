"""`gpt2lab eval hellaswag|loss` on an exported tiny model vs plain transformers loops."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import DATA

from gpt2lab.cli import main
from gpt2lab.data.tokenizer import asset_path, gpt2_tokenizer

SLICE = str(DATA / "hellaswag_val_200.jsonl")


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def _hf(d: str):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.GPT2LMHeadModel.from_pretrained(d).eval()


def test_eval_hellaswag_cli_matches_transformers(tmp_path, capsys):
    import transformers
    from conftest import argmin, reference_scores

    from gpt2lab.evals.hellaswag import load_examples

    torch.manual_seed(1)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=128, vocab_size=50257)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        model.transformer.wte.weight.mul_(5)  # logits far from uniform: no near-ties between endings
    d = str(tmp_path / "hf")
    model.save_pretrained(d)
    rc = main(
        [
            "eval",
            "hellaswag",
            "--model",
            d,
            "--data",
            SLICE,
            "--limit",
            "12",
            "--batch-size",
            "4",
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ]
    )
    assert rc == 0
    result = _last_json(capsys.readouterr().out)
    examples = load_examples(SLICE, limit=12)
    ref = reference_scores(_hf(d), examples)
    acc = sum(argmin(s) == ex.label for ex, (s, _) in zip(examples, ref)) / 12
    acc_norm = sum(argmin(m) == ex.label for ex, (_, m) in zip(examples, ref)) / 12
    assert result.pop("inference")["dtype"] == "float32"  # asked for; the kernel is measured
    assert result == {"task": "hellaswag", "n": 12, "acc": acc, "acc_norm": acc_norm}


def test_eval_hellaswag_cli_bad_input(gpt2_vocab_export, tmp_path, capsys):
    _, d = gpt2_vocab_export
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": "x", "endings": ["a", "b", "c", "d"], "label": 9}\n')
    with pytest.raises(SystemExit, match=f"{bad}:1: 'label' must be an integer 0-3"):
        main(["eval", "hellaswag", "--model", d, "--data", str(bad), "--device", "cpu"])
    with pytest.raises(SystemExit) as e:  # a flag: exit 2
        main(["eval", "hellaswag", "--model", d, "--data", SLICE, "--limit", "0"])
    assert e.value.code == 2 and capsys.readouterr().err.strip().endswith("--limit: must be a positive number, got 0")


def _val_shards(tmp_path, chars: int = 20_000) -> tuple[str, np.ndarray]:
    from gpt2lab.data.shards import shard_name, write_shard

    with open(asset_path("tinyshakespeare.txt"), encoding="utf-8") as f:
        text = f.read(chars)
    tokens = np.array(gpt2_tokenizer().encode_ordinary(text), dtype=np.uint16)
    d = tmp_path / "shards"
    d.mkdir()
    write_shard(d / shard_name("val", 0), tokens)
    return str(d), tokens


def test_eval_loss_cli_matches_transformers(gpt2_vocab_export, tmp_path, capsys):
    _, d = gpt2_vocab_export
    data, tokens = _val_shards(tmp_path)
    B, T, n_tokens = 2, 64, 512
    rc = main(
        [
            "eval",
            "loss",
            "--model",
            d,
            "--data",
            data,
            "--tokens",
            str(n_tokens),
            "--batch-size",
            str(B),
            "--seq-len",
            str(T),
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ]
    )
    assert rc == 0
    result = _last_json(capsys.readouterr().out)
    # Independent: the first 512 target tokens, read in order as 8 rows of 64, scored by transformers.
    buf = torch.tensor(tokens[: n_tokens + 1].astype(np.int64))
    x, y = buf[:-1].view(-1, T), buf[1:].view(-1, T)
    with torch.no_grad():
        logits = _hf(d)(x).logits
    expected = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)).item()
    assert result["task"] == "loss" and result["split"] == "val" and result["tokens"] == n_tokens
    assert result["loss"] == pytest.approx(expected, abs=1e-4)


def test_eval_loss_cli_missing_dir(gpt2_vocab_export, tmp_path, capsys):
    _, d = gpt2_vocab_export
    missing = str(tmp_path / "nowhere")
    argv = ["eval", "loss", "--model", d, "--data", missing, "--tokens", "128", "--seq-len", "64", "--device", "cpu"]
    assert main(argv) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"gpt2lab eval loss: {missing}: ")


def test_eval_loss_cli_takes_a_small_split_whole_with_a_note(gpt2_vocab_export, tmp_path, capsys, monkeypatch):
    """More --tokens than the split holds: as train does with --eval-tokens, every whole batch of the
    split, a note saying so, the loss equal to transformers' on exactly those tokens."""
    monkeypatch.setenv("GPT2LAB_PROBE", "0")  # the device's rule: no timing of the kernels
    _, d = gpt2_vocab_export
    data, tokens = _val_shards(tmp_path, chars=2_000)  # some 500 tokens
    B, T = 2, 64
    batches = ((len(tokens) - 1) // T) // B  # sequences of T and the token after, B a batch
    used = batches * B * T
    argv = ["eval", "loss", "--model", d, "--data", data, "--tokens", "1000000", "--batch-size", str(B)]
    assert main([*argv, "--seq-len", str(T), "--device", "cpu", "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    assert (
        f"gpt2lab eval loss: note: --tokens 1,000,000 is more than the val split of {data} holds; the "
        f"evaluation takes all it holds in whole batches: {used:,} tokens ({batches} of {B} x {T})"
    ) in err
    result = _last_json(out)
    buf = torch.tensor(tokens[: used + 1].astype(np.int64))
    x, y = buf[:-1].view(-1, T), buf[1:].view(-1, T)
    with torch.no_grad():
        logits = _hf(d)(x).logits
    expected = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)).item()
    assert result["tokens"] == used and result["loss"] == pytest.approx(expected, abs=1e-4)


def test_eval_loss_cli_refuses_a_split_smaller_than_one_batch(gpt2_vocab_export, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GPT2LAB_PROBE", "0")
    _, d = gpt2_vocab_export
    data, tokens = _val_shards(tmp_path, chars=2_000)
    B = (len(tokens) - 1) // 64 + 1  # one sequence more than the split holds
    argv = ["eval", "loss", "--model", d, "--data", data, "--batch-size", str(B), "--seq-len", "64"]
    assert main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the inference decision, then the refusal alone
    assert err[-1] == (
        f"gpt2lab eval loss: {data}: split 'val' has {(B - 1) * 64} tokens in sequences of 64, fewer than the "
        f"{B * 64} requested; lower --batch-size or prepare a larger split"
    )
    assert not any("note:" in line for line in err)
