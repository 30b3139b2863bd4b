"""HF weights in and out, checked against transformers' own GPT2LMHeadModel."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import TINY_SHAPES, tiny_gpt

from gpt2lab import GPT, from_pretrained
from gpt2lab.weights import export, load
from gpt2lab.weights.load import CHECKPOINT_DIR, HF_DIR, load_model, source_kind


def _max_diff(ours: GPT, theirs, idx: torch.Tensor, vocab: int | None = None) -> float:
    with torch.no_grad():
        a, _ = ours(idx)
        b = theirs(idx).logits
    vocab = vocab or b.size(-1)
    return (a[..., :vocab] - b[..., :vocab]).abs().max().item()


@pytest.mark.parametrize("i", range(len(TINY_SHAPES)))
def test_from_pretrained_dir_matches_transformers(hf_dirs, i):
    theirs, d = hf_dirs[i]
    ours = from_pretrained(d)  # the Python API's loader, the CLI's too
    c = theirs.config
    assert (ours.config.n_layer, ours.config.n_head, ours.config.n_embd) == (c.n_layer, c.n_head, c.n_embd)
    assert ours.lm_head.weight is ours.transformer.wte.weight
    idx = torch.randint(0, c.vocab_size, (3, c.n_positions))
    assert _max_diff(ours, theirs, idx) <= 1e-4


def test_pytorch_model_bin_with_bare_keys_and_mask_buffers(hf_dirs, tmp_path):
    """OpenAI's original files: no ``transformer.`` prefix, attn.bias mask buffers, a .bin pickle."""
    theirs, d = hf_dirs[1]
    sd = {k.removeprefix("transformer."): v for k, v in theirs.state_dict().items() if k != "lm_head.weight"}
    n_pos = theirs.config.n_positions
    for layer in range(theirs.config.n_layer):
        sd[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(n_pos, n_pos)).view(1, 1, n_pos, n_pos)
        sd[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with open(os.path.join(d, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    ours = load_model(str(tmp_path))
    idx = torch.randint(0, theirs.config.vocab_size, (2, 40))
    assert _max_diff(ours, theirs, idx) <= 1e-4


@pytest.mark.parametrize(
    "shape",
    [
        dict(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=128),
        dict(n_layer=3, n_head=4, n_embd=48, block_size=80, vocab_size=300),
    ],
)
def test_export_loads_in_transformers_with_same_logits(tmp_path, shape):
    import transformers

    ours = tiny_gpt(seed=5, **shape)
    export.save_pretrained(ours, str(tmp_path / "out"))
    theirs, info = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    idx = torch.randint(0, shape["vocab_size"], (2, shape["block_size"]))
    assert _max_diff(ours, theirs.eval(), idx) <= 1e-4


def test_reverse_round_trip_is_exact(hf_dirs, tmp_path):
    """transformers -> gpt2lab -> export -> transformers gives back the very same tensors."""
    from safetensors.torch import load_file

    theirs, d = hf_dirs[0]
    export.save_pretrained(load_model(d), str(tmp_path / "again"))
    before, after = (
        load_file(os.path.join(d, "model.safetensors")),
        load_file(str(tmp_path / "again/model.safetensors")),
    )
    assert sorted(before) == sorted(after)
    for k in before:
        assert torch.equal(before[k], after[k]), k


def test_padded_vocab_export_trims_to_50257(tmp_path):
    import transformers

    ours = tiny_gpt(seed=1, vocab_size=50304, token_vocab_size=50257, n_embd=32)
    out = str(tmp_path / "padded")
    export.save_pretrained(ours, out)
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert cfg["vocab_size"] == 50257 and cfg["architectures"] == ["GPT2LMHeadModel"]
    assert cfg["activation_function"] == "gelu_new" and cfg["tie_word_embeddings"] is True
    assert cfg["bos_token_id"] == cfg["eos_token_id"] == 50256 and cfg["n_ctx"] == cfg["n_positions"] == 64
    theirs = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert theirs.transformer.wte.weight.shape == (50257, 32)
    idx = torch.randint(0, 50257, (2, 24))
    assert _max_diff(ours, theirs, idx, vocab=50257) <= 1e-4
    back = load_model(out)
    assert back.config.vocab_size == 50257


def test_export_has_tokenizer_files_autotokenizer_loads(gpt2_vocab_export):
    import transformers

    _, d = gpt2_vocab_export
    for name in (
        "config.json",
        "model.safetensors",
        "vocab.json",
        "merges.txt",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        assert os.path.isfile(os.path.join(d, name)), name
    tok = transformers.AutoTokenizer.from_pretrained(d)
    assert tok("Hello, I'm a language model,")["input_ids"] == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    assert tok.eos_token_id == 50256


def test_save_pretrained_replaces_an_earlier_export_and_leaves_no_temp(tmp_path):
    out = tmp_path / "exp"
    export.save_pretrained(tiny_gpt(seed=0), str(out))
    first = (out / "model.safetensors").read_bytes()
    export.save_pretrained(tiny_gpt(seed=1), str(out))  # an earlier export (it has the marker): replaced
    assert (out / "model.safetensors").read_bytes() != first
    assert sorted(os.listdir(tmp_path)) == ["exp"]
    assert oct(os.stat(out).st_mode & 0o777) != oct(0o700)  # umask permissions, not mkdtemp's


def test_export_into_a_checkpoint_a_runs_checkpoints_or_an_export_with_a_readme_names_what_is_there(
    gpt2_vocab_export, tmp_path, capsys
):
    """A checkpoint has no run_info.json: the refusal says checkpoint and lists its files; a run's
    checkpoints folder is not "files that gpt2lab did not write"; an earlier export beside the user's
    README.md is an export that replacing would take the README.md with."""
    import shutil
    import types

    from gpt2lab import cli
    from gpt2lab.checkpoint import store
    from gpt2lab.train.config import TrainConfig

    _, src = gpt2_vocab_export
    model = tiny_gpt()
    trainer = types.SimpleNamespace(state_dict=lambda: {"step": 2})  # the trainer's part of state.pt
    parts = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "trainer": trainer}
    ckpt = store.save(str(tmp_path / "run"), 2, parts, TrainConfig().to_dict())
    before = sorted(os.listdir(ckpt))
    assert "run_info.json" not in before
    carded = shutil.copytree(src, tmp_path / "carded")
    (carded / "README.md").write_text("my model card")
    for out, said in (
        (ckpt, f"holds a gpt2lab checkpoint ({', '.join(before[:4])}, ...)"),
        (os.path.dirname(ckpt), "holds a gpt2lab run's checkpoints (step_000002)"),
        (
            carded,
            "holds a gpt2lab export (gpt2lab_export.json, written by `gpt2lab export`) and README.md, which "
            "gpt2lab did not write and replacing it would remove",
        ),
    ):
        assert cli.main(["export", src, str(out)]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line == f"gpt2lab export: {out}: {said}; nothing was written there; choose a new or empty OUT_DIR"
    assert sorted(os.listdir(ckpt)) == before and (carded / "README.md").read_text() == "my model card"


def test_mismatched_weights_and_unsupported_config_are_refused(hf_dirs, tmp_path):
    theirs, d = hf_dirs[0]
    cfg = json.loads(open(os.path.join(d, "config.json")).read())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "n_embd": 64}))
    os.link(os.path.join(d, "model.safetensors"), tmp_path / "model.safetensors")
    with pytest.raises(load.WeightsError, match="model.safetensors"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "activation_function": "relu"}))
    with pytest.raises(load.WeightsError, match="activation_function"):
        load_model(str(tmp_path))


def test_checkpoint_like_dir_is_not_taken_for_hf(tmp_path):
    """gpt2lab checkpoints also hold config.json + model.safetensors; model_type tells them apart."""
    (tmp_path / "config.json").write_text(json.dumps({"n_layer": 2}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert source_kind(str(tmp_path)) == CHECKPOINT_DIR
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert source_kind(str(tmp_path)) == HF_DIR


def test_from_hub_offline_gives_clear_error(tmp_path, monkeypatch):
    """No cache, HF_HUB_OFFLINE=1: a message saying to pass a local dir, never a network call
    (the endpoint points at a closed local port, so a stray request would fail, not hang)."""
    import huggingface_hub.constants

    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"), "HF_ENDPOINT": "http://127.0.0.1:9"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf_home" / "hub"))
    for entry in (from_pretrained,):  # the Python API's hub path, as `--model gpt2`'s
        with pytest.raises(load.WeightsError, match="^gpt2: openai-community/gpt2.*offline.*local directory"):
            entry("gpt2")
    assert not list((tmp_path / "hf_home").rglob("*.safetensors"))
