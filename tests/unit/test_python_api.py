"""The Python API's loaders: ``gpt2lab.from_pretrained`` and ``gpt2lab.get_tokenizer`` take what the
CLI's ``--model`` takes (a run directory, a checkpoint, an HF directory; the hub is test_hf's), through
the CLI's own loader, and a bad source is an exception naming it, never SystemExit."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from conftest import ROOT, damaged_copy, tiny_gpt
from safetensors.torch import load_file

import gpt2lab
from gpt2lab import GPT
from gpt2lab.system.errors import CheckpointError
from gpt2lab.weights.load import WeightsError, load_model


def _same_weights(a: GPT, b: GPT) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("entry", [gpt2lab.from_pretrained, GPT.from_pretrained], ids=["gpt2lab", "GPT"])
def test_a_finished_run_and_its_checkpoints_load_as_sample_loads_them(finished_run, entry):
    run = str(finished_run)
    newest, older = (os.path.join(run, "checkpoints", f"step_00000{s}") for s in (4, 2))
    for source, ckpt in ((run, newest), (newest, newest), (older, older)):
        model = entry(source)
        assert type(model) is GPT and not model.training
        _same_weights(model, load_model(source))  # `gpt2lab sample --model SOURCE`'s loader
        saved = load_file(os.path.join(ckpt, "model.safetensors"))  # the bytes the run wrote
        assert {k for k in model.state_dict() if k != "lm_head.weight"} == set(saved)
        for k, t in saved.items():
            assert torch.equal(model.state_dict()[k], t), (source, k)
        assert model.lm_head.weight is model.transformer.wte.weight
    assert not torch.equal(entry(older).transformer.wte.weight, entry(run).transformer.wte.weight)


@pytest.mark.parametrize("entry", [gpt2lab.from_pretrained, GPT.from_pretrained], ids=["gpt2lab", "GPT"])
def test_an_hf_directory_loads_with_the_exported_models_logits(gpt2_vocab_export, entry):
    model, d = gpt2_vocab_export
    loaded = entry(d, device="cpu")
    idx = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(idx)[0], model(idx)[0])


def test_gpt_from_pretrained_is_the_one_loader(finished_run, gpt2_vocab_export):
    """The seed's habit, ``GPT.from_pretrained(SOURCE)``: the logits of ``gpt2lab.from_pretrained(SOURCE)``,
    for a run directory and an HF export, and those of the model that was exported."""
    exported, d = gpt2_vocab_export
    idx = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for source in (str(finished_run), d):
            model = GPT.from_pretrained(source)
            assert type(model) is GPT and not model.training
            assert torch.equal(model(idx)[0], gpt2lab.from_pretrained(source)(idx)[0]), source
        assert torch.allclose(model(idx)[0], exported.eval()(idx)[0], atol=1e-5)


def test_a_bad_source_raises_an_error_naming_it(tmp_path, gpt2_vocab_export, finished_run):
    """What `--model` prints as one line (exit 1, or 3 for a damaged checkpoint), the library raises:
    an exception whose message starts with the source, not SystemExit."""
    a_file, empty = tmp_path / "weights.bin", tmp_path / "empty"
    a_file.write_bytes(b"x")
    empty.mkdir()
    cut = damaged_copy(gpt2_vocab_export[1], str(tmp_path / "cut"), "weights")
    cases = [  # (source, what from_pretrained says, what get_tokenizer says)
        (tmp_path / "nowhere", *["no such directory, and not a GPT-2 hub name"] * 2),
        (a_file, "is a file", "not a Hugging Face tokenizer.json"),  # get_tokenizer takes a tokenizer.json
        (empty, *["neither a checkpoint"] * 2),
        (tmp_path / "cut", f"{cut}: cannot be read", None),  # get_tokenizer reads no weights: it has its tokenizer
    ]
    for source, *whys in cases:
        for entry, why in zip((gpt2lab.from_pretrained, gpt2lab.get_tokenizer), whys):
            if why is None:
                continue
            with pytest.raises(WeightsError) as e:
                entry(str(source))
            assert str(e.value).startswith(f"{source}: ") and why in str(e.value), str(e.value)
            assert e.value.exit_code == 1
    for entry in (gpt2lab.from_pretrained, gpt2lab.get_tokenizer):
        with pytest.raises(WeightsError) as e:
            entry("")
        assert str(e.value) == f"{entry.__name__}(''): an empty path; pass a path or a hub name"
    damaged = tmp_path / "run"
    shutil.copytree(finished_run, damaged)
    weights = damaged / "checkpoints" / "step_000004" / "model.safetensors"
    os.truncate(weights, os.path.getsize(weights) // 2)
    newest, before = (str(damaged / "checkpoints" / f"step_00000{n}") for n in (4, 2))
    with pytest.raises(CheckpointError, match=f"step_000004 is damaged: .*; use an earlier one: {before}$") as e:
        gpt2lab.from_pretrained(newest)  # named itself: refused
    assert e.value.exit_code == 3
    with pytest.warns(UserWarning, match=f"checkpoint {newest} is damaged .*; trying the one before it"):
        model = gpt2lab.from_pretrained(str(damaged))  # the run: its newest intact checkpoint, the damaged one named
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(model(x)[0], gpt2lab.from_pretrained(before)(x)[0])


def test_init_from_reads_a_source_as_the_loader_does(tmp_path, gpt2_vocab_export):
    """One reading of a source (weights.load.source_kind): --init-from says what --model and the API say."""
    from gpt2lab.train.init_from import InitFromError, find_source

    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"x")
    for source in (a_file, tmp_path / "nowhere"):
        with pytest.raises(WeightsError) as api:
            gpt2lab.from_pretrained(str(source))
        with pytest.raises(InitFromError) as init:
            find_source(str(source))
        assert str(init.value) == f"--init-from {api.value}"
    assert find_source(gpt2_vocab_export[1]).kind == "hf_dir"


def test_get_tokenizer_takes_a_source_and_refuses_other_types(finished_run, gpt2_vocab_export, tmp_path):
    """No argument or a GPT-2 model: GPT-2's BPE; a wrong type is a TypeError naming the parameter (a bool
    was once taken as the chat flag, silently)."""
    from gpt2lab.data.tokenizer import gpt2_tokenizer

    assert gpt2lab.get_tokenizer() is gpt2_tokenizer()
    for source in (str(finished_run), gpt2_vocab_export[1], "gpt2", tmp_path.__class__(gpt2_vocab_export[1])):
        assert gpt2lab.get_tokenizer(source).encode("Hello, I'm a language model,") == [
            15496,
            11,
            314,
            1101,
            257,
            3303,
            2746,
            11,
        ]
    for bad in (True, False, 3, b"runs/x", ["gpt2"]):
        with pytest.raises(TypeError, match=r"get_tokenizer\(source\): a path or a hub name"):
            gpt2lab.get_tokenizer(bad)
        with pytest.raises(TypeError, match=r"from_pretrained\(source\): a path or a hub name"):
            gpt2lab.from_pretrained(bad)


def test_generate_is_seeded_as_the_docs_say():
    """docs/export.md: generate() draws from ``generator=``, else from torch's global generator, so
    ``torch.manual_seed(42)`` before the call gives the text of ``generator=Generator().manual_seed(42)``."""
    model = tiny_gpt(seed=3, n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=97)
    idx = torch.randint(0, 97, (2, 4), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=30, temperature=0.8, top_k=50)
    seeded = gpt2lab.generate(model, idx, generator=torch.Generator("cpu").manual_seed(42), **kw)
    with torch.random.fork_rng():  # the global generator as it was after the test
        torch.manual_seed(42)
        assert torch.equal(gpt2lab.generate(model, idx, **kw), seeded)
        torch.manual_seed(43)
        assert not torch.equal(gpt2lab.generate(model, idx, **kw), seeded)
    assert "torch.manual_seed(42)` before the call seeds it too" in " ".join(
        (ROOT / "docs/export.md").read_text().split()
    )
