"""Fine-tuning: --init-from (HF dir, run dir), dropout, LoRA, the finetune-shakespeare preset,
and the messages for a source that cannot start a run. References: transformers' GPT-2 and
torch.optim.AdamW, the source checkpoint's own tensors, and the model before training."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, adapt_config, hf_gpt2, step_record, tiny_gpt
from safetensors.torch import load_file

from gpt2lab import cli
from gpt2lab.distributed.dist import DistInfo
from gpt2lab.model.sampling import generate
from gpt2lab.train.init_from import InitFromError, sha256_file
from gpt2lab.train.run import train
from gpt2lab.train.settings import load_preset
from gpt2lab.train.trainer import Trainer
from gpt2lab.weights import export, gpt2
from gpt2lab.weights.load import load_model

CPU = torch.device("cpu")
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
# A GPT-2 with the real vocabulary (gpt2lab trains with the GPT-2 tokenizer), tiny otherwise.
SRC_SHAPE = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=50257, **NO_DROPOUT)


@pytest.fixture(scope="module")
def hf_src(tmp_path_factory):
    """(transformers GPT2LMHeadModel, the directory its save_pretrained wrote)."""
    model = hf_gpt2(seed=5, **SRC_SHAPE)
    d = tmp_path_factory.mktemp("hfsrc") / "gpt2-tiny"
    model.save_pretrained(str(d))
    return model, str(d)


@pytest.fixture(scope="module")
def pretrained_run(tiny_data, tmp_path_factory):  # noqa: F811
    """A gpt2lab run pre-trained for a few steps on Tiny Shakespeare (the run-dir source)."""
    out = tmp_path_factory.mktemp("pre") / "run"
    cfg = load_preset(
        "shakespeare-cpu",
        **{**TINY, "data": tiny_data, "out": str(out), "max_steps": 8, "block_size": 64, "ckpt_interval": 4},
        keep_checkpoints=2,  # both: an older checkpoint is taken when named
    )
    train(cfg, DistInfo(device=CPU))
    return str(out)


def _cfg(data: str, out, preset: str = "shakespeare-cpu", **fields):
    return load_preset(preset, **{**TINY, "data": data, "out": str(out), **fields})


def _batches(n: int, seed: int = 0, B: int = 2, T: int = 32):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 50257, (B, T + 1), generator=g) for _ in range(n)]
    return [(s[:, :-1].contiguous(), s[:, 1:].contiguous()) for s in seqs]


def test_hf_source_loss_and_adamw_steps_match_transformers(hf_src, tiny_data, tmp_path):  # noqa: F811
    """Step 0's loss is transformers' on the same batch; after 4 AdamW steps the weights are
    those of transformers + torch.optim.AdamW with the same settings (constant LR, clip 1)."""
    ref, src_dir = hf_src
    cfg = adapt_config(
        _cfg(
            tiny_data,
            tmp_path / "run",
            init_from=src_dir,
            vocab_size=50257,
            block_size=64,
            total_batch_tokens=64,
            max_lr=1e-3,
            min_lr=1e-3,
            warmup_steps=0,
            weight_decay=0.1,
            grad_clip=1.0,
        )
    )
    trainer = Trainer.from_config(cfg, DistInfo(device=CPU))
    batches = _batches(4)
    feed = iter(batches)
    trainer.loader.next_batch = lambda seq_len=None: next(feed)

    ref = hf_gpt2(seed=5, **SRC_SHAPE)  # the same weights as the saved source, trained separately
    ref.load_state_dict(hf_src[0].state_dict())
    ref.train()
    params = [p for p in ref.parameters()]
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    for step, (x, y) in enumerate(batches):
        rec = step_record(trainer)
        logits = ref(x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        if step == 0:
            assert abs(rec["train_loss"] - loss.item()) < 1e-5
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    expected = gpt2.from_hf_state_dict(ref.state_dict(), trainer.raw.config)
    got = dict(trainer.raw.named_parameters())
    worst = max((got[k] - v).abs().max().item() for k, v in expected.items())
    assert worst < 2e-5, worst  # 4 steps of lr 1e-3: moved ~4e-3, agreeing to fp32 rounding


def test_run_dir_source_gives_its_weights_and_a_fresh_start(pretrained_run, tiny_data, tmp_path):  # noqa: F811
    ckpt = f"{pretrained_run}/checkpoints/step_000008"
    cfg = adapt_config(_cfg(tiny_data, tmp_path / "ft", init_from=pretrained_run, block_size=64))
    trainer = Trainer.from_config(cfg, DistInfo(device=CPU))
    saved = load_file(f"{ckpt}/model.safetensors")
    assert set(saved) == set(dict(trainer.raw.named_parameters()))
    for k, v in trainer.raw.named_parameters():
        assert torch.equal(v.detach(), saved[k]), k
    assert trainer.step == 0 and trainer.tokens == 0 and not trainer.optimizer.state
    fresh = Trainer.from_config(_cfg(tiny_data, tmp_path / "x"), DistInfo(device=CPU))
    assert trainer.loader.state_dict() == fresh.loader.state_dict()
    assert trainer.plan.init_record["id"] == f"step 8, sha256:{sha256_file(f'{ckpt}/model.safetensors')}"
    # a smaller block keeps the first positions; the older checkpoint is taken when named
    short = Trainer.from_config(
        adapt_config(
            _cfg(
                tiny_data,
                tmp_path / "s",
                init_from=f"{pretrained_run}/checkpoints/step_000004",
                block_size=32,
                seq_len=32,
            )
        ),
        DistInfo(device=CPU),
    )
    older = load_file(f"{pretrained_run}/checkpoints/step_000004/model.safetensors")
    assert torch.equal(short.raw.transformer.wpe.weight.detach(), older["transformer.wpe.weight"][:32])


def test_vocab_padding_rows_are_the_mean_and_loss_stays(hf_src, tiny_data, tmp_path):  # noqa: F811
    """50257 rows into a 50304 run: the 47 new rows are the mean row; the loss barely moves."""
    ref, src_dir = hf_src
    cfg = adapt_config(_cfg(tiny_data, tmp_path / "run", init_from=src_dir))
    trainer = Trainer.from_config(cfg, DistInfo(device=CPU))
    wte = trainer.raw.transformer.wte.weight.detach()
    src_wte = ref.transformer.wte.weight.detach()
    assert wte.shape[0] == 50304 and torch.equal(wte[:50257], src_wte)
    assert torch.allclose(wte[50257:], src_wte.mean(0).expand(47, -1))
    x, y = _batches(1)[0]
    ours = trainer.raw(x, y)[1].item()
    theirs = F.cross_entropy(ref(x).logits.reshape(-1, 50257), y.reshape(-1)).item()
    assert abs(ours - theirs) < 2e-3  # 47 average-logit rows of 50304 take ~0.1% of the mass


def test_dropout_trains_stochastically_but_evaluates_like_none(tmp_path):
    plain = tiny_gpt(seed=1)
    drop = tiny_gpt(seed=1, embd_pdrop=0.1, attn_pdrop=0.1, resid_pdrop=0.1)
    drop.load_state_dict(plain.state_dict())
    x = torch.randint(0, 128, (2, 16))
    drop.train()
    a, b = drop(x)[0], drop(x)[0]
    assert not torch.allclose(a, b)
    drop.eval()
    assert torch.equal(drop(x)[0], plain(x)[0])
    g = [torch.Generator().manual_seed(0) for _ in range(2)]
    assert torch.equal(generate(drop, x[:1, :4], 8, generator=g[0]), generate(plain, x[:1, :4], 8, generator=g[1]))
    # exported: the HF config carries the rates, transformers reads them, and so do we
    import transformers

    export.save_pretrained(drop, str(tmp_path / "exp"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "exp"))
    assert (loaded.config.embd_pdrop, loaded.config.attn_pdrop, loaded.config.resid_pdrop) == (0.1, 0.1, 0.1)
    back = load_model(str(tmp_path / "exp"))
    assert (back.config.embd_pdrop, back.config.attn_pdrop, back.config.resid_pdrop) == (0.1, 0.1, 0.1)
    with torch.no_grad():
        assert torch.allclose(loaded.eval()(x).logits, plain(x)[0], atol=1e-5)


def test_lora_trains_only_adapters_and_merged_export_matches(hf_src, tiny_data, tmp_path):  # noqa: F811
    import transformers

    # the fine-tuning preset (dropout 0.1) from the tiny HF directory, with tiny overrides
    cfg = adapt_config(
        _cfg(
            tiny_data,
            tmp_path / "lora",
            "finetune-shakespeare",
            init_from=hf_src[1],
            lora_rank=4,
            lora_alpha=8.0,
            lora_targets="c_attn,mlp.c_proj",
            max_steps=3,
            max_lr=1e-2,
            min_lr=1e-2,
            warmup_steps=0,
        )
    )
    assert cfg.model.attn_pdrop == 0.1 and cfg.optim.max_steps == 3
    trainer = Trainer.from_config(cfg, DistInfo(device=CPU))
    before = {k: v.detach().clone() for k, v in trainer.raw.state_dict().items()}
    trainable = {n for n, p in trainer.raw.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == {
        id(p) for n, p in trainer.raw.named_parameters() if n in trainable
    }
    for _ in range(3):
        trainer.train_step()
    after = trainer.raw.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and changed <= {k for k in before if ".lora_B." in k or ".lora_A." in k}
    path = trainer.save()
    resumed = Trainer.from_config(cfg, DistInfo(device=CPU), resume=path)  # the checkpoint holds all a LoRA run needs
    # where the run began: not a setting, read back from the checkpoint by the resumed plan
    assert resumed.step == 3 and resumed.plan.init is None
    assert resumed.plan.init_record == trainer.plan.init_record == trainer.plan.init.record()
    assert resumed.plan.init_record["id"] == f"sha256:{sha256_file(f'{hf_src[1]}/model.safetensors')}"
    for (k, a), b in zip(resumed.raw.state_dict().items(), after.values()):
        assert torch.equal(a, b), k
    moments = [[s["exp_avg"] for s in t.optimizer.state.values()] for t in (resumed, trainer)]
    assert len(moments[0]) == len(trainable) and all(map(torch.equal, *moments))
    export.save_pretrained(load_model(path), str(tmp_path / "exp"))
    exported = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "exp")).eval()
    assert not any("lora" in k for k in exported.state_dict())
    x = torch.randint(0, 50257, (2, 24))
    trainer.raw.eval()
    with torch.no_grad():
        ours = trainer.raw(x)[0][..., :50257]
        assert (exported(x).logits - ours).abs().max().item() < 1e-5


def test_finetune_preset_lowers_held_out_loss(pretrained_run, tiny_data, tmp_path):  # noqa: F811
    """From the pre-trained run, the finetune-shakespeare preset (tiny overrides, through the
    CLI) lowers the loss on the held-out val split below the source's."""
    from conftest import evaluate_loss

    out = tmp_path / "ft"
    rc = cli.main(
        [
            "train",
            "--preset",
            "finetune-shakespeare",
            "--init-from",
            pretrained_run,
            "--data",
            tiny_data,
            "--out",
            str(out),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--compile",
            "false",
            "--seq-len",
            "32",
            "--micro-batch-size",
            "4",
            "--total-batch-tokens",
            "128",
            "--max-steps",
            "10",
            "--max-lr",
            "3e-3",
            "--min-lr",
            "3e-3",
            "--warmup-steps",
            "2",
            "--eval-interval",
            "0",
            "--sample-interval",
            "0",
            "--progress",
            "false",
            "--keep-cpu-memory",
            "false",
        ]
    )
    assert rc == 0
    val = lambda m: evaluate_loss(m, tiny_data, tokens=2048, batch_size=8, seq_len=32, device=CPU)  # noqa: E731
    start, end = val(load_model(pretrained_run)), val(load_model(str(out)))
    assert end < start - 0.3, (start, end)
    saved = json.loads((out / "config.json").read_text())
    assert saved["finetune"]["init_from"] == pretrained_run and "init_from_id" not in json.dumps(saved)
    assert saved["model"]["attn_pdrop"] == 0.1 and saved["model"]["block_size"] == 64
    info = json.loads((out / "run_info.json").read_text())
    weights = f"{pretrained_run}/checkpoints/step_000008/model.safetensors"
    assert (
        info["plan"]["init_from"]["step"] == 8
        and info["plan"]["init_from"]["id"] == f"step 8, sha256:{sha256_file(weights)}"
    )


# ---------------------------------------------------------------- bad input: one line, exit 2


def _train_cli(capsys, *args: str) -> str:
    capsys.readouterr()  # drop what came before (progress bars of the fixtures)
    rc = cli.main(["train", "--preset", "finetune-shakespeare", "--device", "cpu", *args])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_bad_sources_say_which_and_what_to_do(hf_src, pretrained_run, tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert "--init-from " + missing in _train_cli(capsys, "--init-from", missing)
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (llama / "model.safetensors").write_bytes(b"")
    assert "not GPT-2" in _train_cli(capsys, "--init-from", str(llama))
    (llama / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (llama / "model.safetensors").unlink()
    assert "without a weights file" in _train_cli(capsys, "--init-from", str(llama))
    small = tmp_path / "small-vocab"
    hf_gpt2(**{**SRC_SHAPE, "vocab_size": 128}).save_pretrained(str(small))
    assert "128 tokens" in _train_cli(capsys, "--init-from", str(small))
    half = tmp_path / "half" / "step_000008"
    shutil.copytree(f"{pretrained_run}/checkpoints/step_000008", half)
    (half / "state.pt").unlink()
    assert "incomplete checkpoint" in _train_cli(capsys, "--init-from", str(half))
    cut = tmp_path / "cut"
    shutil.copytree(hf_src[1], cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "half-written" in _train_cli(capsys, "--init-from", str(cut))
    only_tmp = tmp_path / "crashed" / "checkpoints" / ".tmp_step_000003_1"
    only_tmp.mkdir(parents=True)
    assert "complete checkpoint" in _train_cli(capsys, "--init-from", str(tmp_path / "crashed"))


def test_flags_that_conflict_with_the_source(hf_src, tmp_path, capsys):
    src = hf_src[1]
    err = _train_cli(capsys, "--init-from", src, "--n-embd", "64")
    assert "n_embd 32" in err and "--n-embd 64" in err
    err = _train_cli(capsys, "--init-from", src, "--block-size", "128")
    assert "block_size 64" in err and "--block-size 128" in err
    # with --resume auto and no checkpoint yet it is the same start (a resume of it: test_resume_advice)
    err = _train_cli(capsys, "--init-from", src, "--resume", "auto", "--out", str(tmp_path / "r"))
    assert "seq_len 1024 exceeds block_size 64" in err
    with pytest.raises(InitFromError, match="n_layer 2 but --n-layer 3"):
        adapt_config(load_preset("finetune-shakespeare", init_from=src, n_layer=3))


def test_hub_name_offline_says_how_to_use_a_local_dir(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    for k, v in {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    err = _train_cli(capsys, "--init-from", "gpt2-xl")
    assert err.startswith("gpt2lab train: --init-from gpt2-xl:") and "--init-from DIR" in err
