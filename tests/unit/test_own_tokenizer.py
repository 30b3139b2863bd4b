"""Your own tokenizer: training it (deterministic, Hugging Face tokenizers' own encoding as the
reference), data prepared with it (uint32 shards too), a run on that data (files travel, bits per
byte), the refusal of data in another tokenizer, and its export in transformers (ids and logits)."""

from __future__ import annotations

import hashlib
import io
import json
import math
import shutil
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import DATA, cli_args, records, tiny_gpt

import gpt2lab
from gpt2lab import cli
from gpt2lab.data import chat
from gpt2lab.data import tokenizer as tokenizers_mod
from gpt2lab.data.bpe import MARKER, SPLIT_PATTERN, open_dir, train_tokenizer

WIKI = str(DATA / "wiki_slice.jsonl.zst")
CHAT = str(DATA / "chat_slice.jsonl.zst")
VOCAB = 1000  # not a multiple of 128: a run pads it to 1024
TURNS = [("system", "You answer briefly."), ("user", "Hello <|im_end|> there, 12345!"), ("assistant", "Hi. Ünïcödé 🙂")]


def _texts(path: str, field: str = "text") -> list[str]:
    """A .jsonl.zst file's texts (or each conversation's contents, one per line), read with zstandard alone."""
    import zstandard

    with open(path, "rb") as f:
        raw = zstandard.ZstdDecompressor().stream_reader(f).read().decode("utf-8")
    rows = [json.loads(line) for line in raw.splitlines() if line.strip()]
    return [r[field] if field in r else "\n".join(m["content"] for m in r["messages"]) for r in rows]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("tok") / "tokenizer")
    train_tokenizer([WIKI, CHAT], VOCAB, out, progress=False)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    return open_dir(tok_dir)


@pytest.fixture(scope="module")
def wiki_data(tok_dir, tmp_path_factory) -> str:
    from gpt2lab.data.prepare import prepare

    out = str(tmp_path_factory.mktemp("wiki") / "data")
    prepare(WIKI, out, tokenizer=tok_dir, progress=False, workers=1)
    return out


@pytest.fixture(scope="module")
def own_run(wiki_data, tmp_path_factory) -> Path:
    """A 6-step run on data prepared with the trained tokenizer, evaluations and checkpoints on."""
    out = tmp_path_factory.mktemp("own") / "run"
    argv = [
        "train",
        "--preset",
        "shakespeare-cpu",
        *cli_args(
            data=wiki_data,
            out=str(out),
            max_steps=6,
            eval_interval=3,
            eval_tokens=128,
            sample_interval=6,
            sample_tokens=8,
            sample_prompt="ROMEO:",  # given: used on any data (the preset's would give way to the data's start)
            ckpt_interval=3,
            keep_checkpoints=0,
        ),
    ]
    assert cli.main(argv) == 0
    return out


# -- training the tokenizer --------------------------------------------------------------------
def test_training_twice_gives_identical_files(tok_dir, tmp_path):
    again = tmp_path / "again"
    train_tokenizer([WIKI, CHAT], VOCAB, str(again), progress=False)
    for name in ("tokenizer.json", "gpt2lab_tokenizer.json"):
        assert (again / name).read_bytes() == (Path(tok_dir) / name).read_bytes()
    marker = json.loads((again / "gpt2lab_tokenizer.json").read_text())
    assert marker["identity"] == hashlib.sha256((again / "tokenizer.json").read_bytes()).hexdigest()
    assert marker["vocab_size"] == VOCAB and marker["split_pattern"] == SPLIT_PATTERN
    assert marker["special_tokens"] == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    expected = [len("".join(_texts(WIKI)).encode()), len("".join(_texts(CHAT)).encode())]
    assert [s["bytes"] for s in marker["sources"]] == expected
    train_tokenizer([WIKI, CHAT], VOCAB, str(again), progress=False)  # an earlier tokenizer is replaced, the same again
    assert (again / "tokenizer.json").read_bytes() == (Path(tok_dir) / "tokenizer.json").read_bytes()


def test_out_must_be_new_empty_or_an_earlier_tokenizer(tok_dir, tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert (
        cli.main(
            ["tokenizer", "train", "--source", WIKI, "--vocab-size", "300", "--out", str(tmp_path / "mine"), "--quiet"]
        )
        == 2
    )
    assert "nothing was written" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]
    assert (
        cli.main(
            ["tokenizer", "train", "--source", WIKI, "--vocab-size", "100", "--out", str(tmp_path / "t"), "--quiet"]
        )
        == 2
    )
    assert "--vocab-size 100: must be 260" in capsys.readouterr().err


def test_it_encodes_as_hf_tokenizers_does_and_decodes_back(tok_dir, tok):
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))  # parses special tokens in text
    text = "".join(_texts(WIKI)[:2]) + " <|endoftext|>x<|im_start|>user\n  naïve 日本語 🙂 1234567\n\tdef f():\n"
    assert tok.encode(text, allowed_special="all") == ref.encode(text).ids
    ordinary = tok.encode_ordinary(text)
    assert not {0, 1, 2} & set(ordinary) and tok.decode(ordinary) == text  # typed markers stay text
    assert b"".join(tok.decode_single_token_bytes(t) for t in ordinary) == text.encode()
    with pytest.raises(ValueError, match="<|endoftext|>"):
        tok.encode(text)  # tiktoken's default: a special token in text is refused
    digits = [tok.decode_single_token_bytes(t) for t in tok.encode_ordinary("1234567 89")]
    assert all(len(d.strip()) <= 3 for d in digits)  # the split puts digits in groups of 1-3


def test_chat_template_takes_the_tokenizers_turn_ids(tok):
    ids, mask = chat.encode_chat(TURNS, tokenizer=tok)
    assert ids[:2] == [0, 1] and ids.count(1) == 3 and ids.count(2) == 3 and len(mask) == len(ids)
    rendered = "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in TURNS)
    assert tok.decode(ids) == "<|endoftext|>" + rendered
    kept = [t for t, m in zip(ids, mask) if m]
    assert tok.decode(kept) == "Hi. Ünïcödé 🙂<|im_end|>"


def test_bytes_per_token_against_gpt2(tok_dir, capsys):
    assert cli.main(["tokenizer", "eval", "--tokenizer", tok_dir, "--source", WIKI, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["sources"][0]
    texts = _texts(WIKI)
    gpt2 = tokenizers_mod.gpt2_tokenizer()
    assert row["bytes"] == sum(len(t.encode()) for t in texts) and row["documents"] == len(texts)
    assert row["tokenizers"]["gpt2"]["tokens"] == sum(len(gpt2.encode_ordinary(t)) for t in texts)
    ours = row["tokenizers"]["ours"]
    assert ours["bytes_per_token"] == pytest.approx(row["bytes"] / ours["tokens"])
    assert cli.main(["tokenizer", "eval", "--tokenizer", tok_dir, "--source", WIKI]) == 0
    cells = capsys.readouterr().out.splitlines()[2].strip("| ").split(" | ")  # the table's row of that source
    gpt2_tokens = row["tokenizers"]["gpt2"]["tokens"]
    assert cells[1:4] == [f"{row['bytes']:,}", f"{row['documents']:,}", f"{ours['tokens']:,}"]
    assert cells[7] == f"{gpt2_tokens / ours['tokens']:.3f}"


# -- data ------------------------------------------------------------------------------------------
def test_prepare_writes_the_tokenizers_ids_and_names_it(wiki_data, tok_dir, tok, capsys):
    from tokenizers import Tokenizer

    from gpt2lab.data.shards import list_shards, open_shard

    manifest = json.loads((Path(wiki_data) / "manifest.json").read_text())
    assert (manifest["tokenizer"], manifest["vocab_size"], manifest["dtype"], manifest["eot_id"]) == (
        tok.identity,
        VOCAB,
        "uint16",
        0,
    )
    assert (Path(wiki_data) / "tokenizer.json").read_bytes() == (Path(tok_dir) / "tokenizer.json").read_bytes()
    ref = Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
    stream = np.concatenate([open_shard(p) for s in ("val", "train") for p in list_shards(wiki_data, s)])
    assert stream.tolist() == [t for text in _texts(WIKI) for t in [0, *ref.encode(text).ids]]
    assert cli.main(["prepare", "--source", WIKI, "--out", wiki_data, "--quiet"]) == 1  # GPT-2's now: refused
    assert "--tokenizer" in capsys.readouterr().err


def test_uint32_shards_for_a_vocabulary_past_65536(tmp_path):
    from gpt2lab.data.loader import TokenLoader
    from gpt2lab.data.shards import open_shard, write_shard
    from gpt2lab.data.tokenizer import token_dtype

    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    toks = np.random.default_rng(0).integers(1, 70000, 1000).astype(np.uint32)
    toks[::50] = 0  # <|endoftext|> at 0, as a trained tokenizer has it
    for split in ("train", "val"):
        write_shard(tmp_path / f"{split}_000000.bin", toks)
    header = np.fromfile(tmp_path / "val_000000.bin", dtype=np.int32, count=3)
    assert header.tolist() == [20240801, 7, 1000]  # llm.c's header of uint32 shards
    assert open_shard(tmp_path / "val_000000.bin").dtype == np.uint32
    manifest = {"format": "gpt2lab-token-shards", "version": 2, "vocab_size": 70000, "eot_id": 0, "dtype": "uint32"}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    x, y = TokenLoader(tmp_path, "val", 2, 16).next_batch()
    assert x.flatten().tolist() == toks[:32].tolist() and y[0].tolist() == toks[1:17].tolist()
    with pytest.raises(TypeError, match="uint16 or uint32"):
        write_shard(tmp_path / "x.bin", toks.astype(np.int64))


# -- a run on it -----------------------------------------------------------------------------------
def test_a_run_takes_the_datas_tokenizer_and_it_travels(own_run, tok, monkeypatch):
    from gpt2lab.data.tokenizer import for_model
    from gpt2lab.weights.load import load_model

    model_cfg = json.loads((own_run / "config.json").read_text())["model"]
    assert (model_cfg["tokenizer"], model_cfg["token_vocab_size"], model_cfg["vocab_size"]) == (
        tok.identity,
        VOCAB,
        1024,
    )
    for where in (own_run, own_run / "checkpoints" / "step_000003", own_run / "checkpoints" / "step_000006"):
        assert (where / "tokenizer.json").read_text() == tok.text
    assert "tokenizer.json" in json.loads((own_run / "checkpoints" / "step_000006" / "checksums.json").read_text())
    vals = [r for r in records(own_run) if "val_loss" in r]
    assert [r["step"] for r in vals] == [0, 3, 6] and all(0 < r["val_bpb"] < r["val_loss"] for r in vals)
    sample = next(r["sample"] for r in records(own_run) if "sample" in r)
    assert sample.startswith("ROMEO:")  # the prompt back: encoded and decoded with the run's own tokenizer
    alone = own_run.parent / "alone"  # a checkpoint copied away, in a process that never saw the tokenizer
    shutil.copytree(own_run / "checkpoints" / "step_000006", alone)
    model = load_model(str(alone))
    assert for_model(model).identity == tok.identity


def test_get_tokenizer_of_a_run_encodes_as_its_exports_autotokenizer(own_run, tok, tmp_path):
    """gpt2lab.get_tokenizer(RUN): the run's own tokenizer, read from the run with no weights loaded, the
    same ids as transformers' AutoTokenizer of the run's export and as the model from_pretrained carries."""
    import transformers

    import gpt2lab

    transformers.logging.set_verbosity_error()
    ours = gpt2lab.get_tokenizer(str(own_run))
    assert ours.identity == tok.identity and gpt2lab.from_pretrained(str(own_run)).tokenizer.identity == tok.identity
    out = str(tmp_path / "export")
    assert cli.main(["export", str(own_run), out]) == 0
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for text in ["ROMEO: But soft, what light", "The city's 1,234 bridges — naïve 日本 🙂\n    indented", " x  y\t"]:
        assert ours.encode(text, allowed_special="all") == theirs(text)["input_ids"] == tok.encode(text)
    assert gpt2lab.get_tokenizer(out).identity == tok.identity  # the export's, read back
    assert gpt2lab.get_tokenizer(str(own_run / "checkpoints" / "step_000003")).identity == tok.identity


def test_report_and_compare_show_bits_per_byte(own_run):
    from gpt2lab.observe.compare import load_curve
    from gpt2lab.observe.report import build_report

    vals = [r for r in records(own_run) if "val_bpb" in r]
    rep = build_report(str(own_run), curves=False)
    rows = {row[0]: row[1] for s in rep.sections if s.table for row in s.table[1:]}
    assert rows["val bits per byte (the loss over the text's UTF-8 bytes)"] == f"{vals[-1]['val_bpb']:.4f} (step 6)"
    identity = json.loads((own_run / "config.json").read_text())["model"]["tokenizer"]
    assert rows["tokenizer"] == f"sha256:{identity[:12]}, 1,000 tokens"
    assert [p[3] for p in load_curve(str(own_run), "val_bpb").points] == [r["val_bpb"] for r in vals]


def _one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("dry", [False, True])
def test_data_in_another_tokenizer_is_refused_before_the_first_step(
    own_run,
    tiny_data,
    wiki_data,  # noqa: F811
    tmp_path,
    capsys,
    dry,
):
    flag = ["--dry-run"] if dry else []
    out = tmp_path / "from_own"
    argv = [
        "train",
        "--preset",
        "shakespeare-cpu",
        *cli_args(data=tiny_data, out=str(out), init_from=str(own_run)),
        *flag,
    ]
    assert cli.main(argv) == 2
    model_tok = json.loads((own_run / "config.json").read_text())["model"]["tokenizer"]
    assert _one_line(capsys.readouterr().err) == (
        f"gpt2lab train: --data {tiny_data} was prepared with GPT-2's BPE, but the model of --init-from {own_run} "
        f"uses sha256:{model_tok[:12]}; prepare it with that model's tokenizer (gpt2lab prepare --tokenizer DIR, "
        "DIR holding its tokenizer.json: the run, checkpoint or export), or start from another model"
    )
    assert not out.exists()
    resumed = tmp_path / "resumed"  # a copy of the run resumed on GPT-2's data
    shutil.copytree(own_run, resumed)
    before = sorted(p.name for p in resumed.rglob("*"))
    argv = [
        "train",
        "--preset",
        "shakespeare-cpu",
        *cli_args(data=tiny_data, out=str(resumed), max_steps=9),
        "--resume",
        "auto",
        *flag,
    ]
    assert cli.main(argv) == 2
    assert "was prepared with GPT-2's BPE, but the model of the checkpoint" in _one_line(capsys.readouterr().err)
    assert sorted(p.name for p in resumed.rglob("*")) == before
    from gpt2lab.weights import export

    gpt2 = str(tmp_path / "gpt2")  # and a GPT-2 model (TINY's shape) onto data in the trained tokenizer
    export.save_pretrained(tiny_gpt(vocab_size=50257, block_size=32), gpt2)
    argv = [
        "train",
        "--preset",
        "shakespeare-cpu",
        *cli_args(data=wiki_data, out=str(tmp_path / "gpt2_from"), init_from=gpt2),
        *flag,
    ]
    assert cli.main(argv) == 2
    assert f"was prepared with sha256:{model_tok[:12]}, but the model of --init-from" in _one_line(
        capsys.readouterr().err
    )


def test_vocab_size_follows_the_tokenizer_unless_given(wiki_data, tmp_path):
    from gpt2lab.system import runtime
    from gpt2lab.system.errors import ConfigError
    from gpt2lab.train.config import merge_config
    from gpt2lab.train.gather import MachineFacts
    from gpt2lab.train.plan import Request, make_plan
    from gpt2lab.train.settings import preset_values

    facts = MachineFacts(runtime.Facts("cpu", "x", ()))

    def values(**model):
        return merge_config(
            preset_values("shakespeare-cpu"),
            {  # noqa: E731
                "data": wiki_data,
                "out": str(tmp_path / "r"),
                "system": {"dtype": "float32", "compile": "false"},
                "model": model,
            },
        )

    assert make_plan(Request(values(), {}), facts).config.model.vocab_size == 1024  # the preset's 50304 gives way
    assert make_plan(Request(values(vocab_size=1152), {"vocab_size": 1152}), facts).config.model.vocab_size == 1152
    with pytest.raises(ConfigError, match="--vocab-size 512 is smaller than the tokenizer's 1000 tokens .* use 1024"):
        make_plan(Request(values(vocab_size=512), {"vocab_size": 512}), facts)


# -- bits per byte ---------------------------------------------------------------------------------
def _hand_bpb(model, data: str, tok, steps: int, B: int, T: int, masked: bool) -> tuple[float, float]:
    """(mean loss, bits per byte) from the val shard's file, read by hand: sequences in order, each
    target's loss by F.cross_entropy, its bytes by decoding it (special tokens: none)."""
    raw = np.fromfile(Path(data) / "val_000000.bin", dtype=np.uint16, offset=1024).astype(np.int64)
    keep = np.fromfile(Path(data) / "val_000000.mask", dtype=np.uint8, offset=1024) if masked else np.ones_like(raw)
    nats, n, n_bytes = 0.0, 0, 0
    with torch.no_grad():
        for s in range(steps * B):
            seq = torch.from_numpy(raw[s * T : s * T + T + 1])
            logits, _ = model(seq[None, :-1])
            losses = F.cross_entropy(logits[0].float(), seq[1:], reduction="none")
            for t, loss, k in zip(seq[1:].tolist(), losses.tolist(), keep[s * T + 1 : s * T + T + 1]):
                if k:
                    nats += loss
                    n += 1
                    n_bytes += 0 if t in (0, 1, 2) else len(tok.decode(([t])).encode())
    return nats / n, nats / (math.log(2) * n_bytes)


@pytest.mark.parametrize("masked", [False, True])
def test_bits_per_byte_is_the_loss_over_the_texts_bytes(wiki_data, tok_dir, tok, tmp_path, masked):
    from gpt2lab.data.prepare import prepare
    from gpt2lab.evals.loss import evaluate

    data = wiki_data
    if masked:  # conversations: the assistant's tokens only
        data = str(tmp_path / "chat")
        prepare(CHAT, data, tokenizer=tok_dir, progress=False, workers=1, val_tokens=2000)
    model = tiny_gpt(seed=1, vocab_size=1024, token_vocab_size=VOCAB, tokenizer=tok)
    res = evaluate(model, data, tokens=3 * 2 * 32, batch_size=2, seq_len=32, device="cpu")
    loss, bpb = _hand_bpb(model, data, tok, 3, 2, 32, masked)
    assert res.loss == pytest.approx(loss, rel=1e-5) and res.bpb == pytest.approx(bpb, rel=1e-5)
    assert 1.5 < bpb < loss  # a random model's bits per byte: its loss over more than one byte per token


def test_eval_loss_reports_bpb_and_refuses_data_in_another_tokenizer(
    own_run,
    wiki_data,
    tiny_data,  # noqa: F811
    capsys,
):
    argv = [
        "eval",
        "loss",
        "--model",
        str(own_run),
        "--tokens",
        "128",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--device",
        "cpu",
        "--dtype",
        "float32",
    ]
    assert cli.main([*argv, "--data", wiki_data]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bpb"] == pytest.approx(out["loss"] * 128 / (math.log(2) * out["bytes"]))
    assert cli.main([*argv, "--data", tiny_data]) == 2
    model_tok = json.loads((own_run / "config.json").read_text())["model"]["tokenizer"]
    err = capsys.readouterr().err  # after the lines on how the model runs
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"gpt2lab eval loss: --data {tiny_data} was prepared with GPT-2's BPE, but the model of --model {own_run} "
        f"uses sha256:{model_tok[:12]}; prepare it with that model's tokenizer (gpt2lab prepare --tokenizer DIR, "
        "DIR holding its tokenizer.json: the run, checkpoint or export), or evaluate another model"
    )


# -- the export ------------------------------------------------------------------------------------
ARCHS = {
    "gpt2": {},
    "modern": dict(
        pos_emb="rotary",
        norm="rmsnorm",
        qk_norm=True,
        mlp_act="relu2",
        bias=False,
        embed_norm=True,
        tie_embeddings=False,
    ),
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("chat_model", [False, True])
def test_export_loads_in_transformers_with_our_ids_and_logits(tok, tmp_path, arch, chat_model):
    import transformers

    from gpt2lab.weights import export
    from gpt2lab.weights.load import load_model

    transformers.logging.set_verbosity_error()
    model = tiny_gpt(
        seed=2,
        vocab_size=1024,
        token_vocab_size=VOCAB,
        tokenizer=tok,
        block_size=128,
        chat_template="chatml" if chat_model else None,
        **ARCHS[arch],
    )
    d = str(tmp_path / "export")
    assert export.save_pretrained(model, d) == {"gpt2": "GPT2LMHeadModel", "modern": "NanoChatForCausalLM"}[arch]
    theirs_tok = transformers.AutoTokenizer.from_pretrained(d)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    text = "<|endoftext|>The city's 1,234 bridges — naïve 日本 🙂\n    indented<|im_end|>"
    ids = theirs_tok(text)["input_ids"]
    assert ids == tok.encode(text, allowed_special="all")
    if chat_model:
        turns = [(r, c.replace("<|im_end|>", "")) for r, c in TURNS]  # transformers would parse a typed marker
        messages = [{"role": r, "content": c} for r, c in turns]
        got = theirs_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert got["input_ids"] == chat.encode_chat(turns, add_generation_prompt=True, tokenizer=tok)[0]
        assert theirs.generation_config.eos_token_id == 2
        pad = theirs.generation_config.pad_token_id  # generate's pad: the byte 0xFF, in no prompt
        assert tok.decode_single_token_bytes(pad) == b"\xff" and pad not in got["input_ids"]
    x = torch.tensor([ids])
    with torch.no_grad():
        ours = model(x)[0][..., :VOCAB]
        torch.testing.assert_close(theirs(x).logits, ours, rtol=1e-4, atol=1e-4)
    back = load_model(d)
    assert (back.config.tokenizer, back.config.chat_template) == (tok.identity, "chatml" if chat_model else None)


def test_a_model_with_its_own_tokenizer_needs_it_given_and_says_how(tok):
    """No registry: a model's own tokenizer is what was read with it, and none (or another) is one line."""
    from gpt2lab.data.tokenizer import TokenizerError, for_config, gpt2_tokenizer
    from gpt2lab.model.config import GPTConfig

    config = GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=VOCAB, tokenizer=tok.identity)
    assert for_config(config, tok) is tok
    with pytest.raises(
        TokenizerError,
        match=r"has its own tokenizer sha256:\w{12} and none was given; read it "
        r"from where the model came from \(gpt2lab.get_tokenizer\(SOURCE\)",
    ):
        for_config(config)
    with pytest.raises(TokenizerError, match="and GPT-2's BPE was given"):
        for_config(config, gpt2_tokenizer())


def test_progress_goes_to_stderr_as_bytes(tmp_path):
    err = io.StringIO()
    with mock.patch.object(sys, "stderr", err):
        train_tokenizer([WIKI], 300, str(tmp_path / "t"), progress=True)
    assert "tokenizer" in err.getvalue() and "B" in err.getvalue()


def test_serve_reads_and_writes_text_in_the_models_tokenizer(tok, tmp_path):
    """Completions (echoed tokens and their logprob names) and chat completions (the template's prompt,
    the reply's text) in the trained tokenizer, for a chat model exported with it."""
    import httpx
    from conftest import running_server

    from gpt2lab.evals.chat import greedy_reply
    from gpt2lab.weights import export

    model = tiny_gpt(
        seed=4, vocab_size=1024, token_vocab_size=VOCAB, tokenizer=tok, block_size=128, chat_template="chatml"
    )
    export.save_pretrained(model, str(tmp_path / "m"))
    text = "def f(x):\n    return x ** 2  # naïve 🙂"
    turns = [("user", "Hello there, what is 12345?")]
    prompt = chat.encode_chat(turns, add_generation_prompt=True, tokenizer=tok)[0]
    reply = greedy_reply(model, prompt, 12)
    with running_server([f"own={tmp_path / 'm'}"]) as url:
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "own", "prompt": text, "echo": True, "max_tokens": 0, "logprobs": 1},
            timeout=60,
        ).json()
        c = httpx.post(
            url + "/v1/chat/completions",
            json={
                "model": "own",
                "max_tokens": 12,
                "temperature": 0,
                "messages": [{"role": r_, "content": t} for r_, t in turns],
            },
            timeout=60,
        ).json()
    ids = tok.encode_ordinary(text)
    assert r["usage"]["prompt_tokens"] == len(ids) and r["choices"][0]["text"] == text
    names = r["choices"][0]["logprobs"]["tokens"]
    assert [n.encode() if not n.startswith("bytes:") else None for n in names] == [
        b if not _split_char(b) else None for b in map(tok.decode_single_token_bytes, ids)
    ]
    assert c["usage"]["prompt_tokens"] == len(prompt)
    assert c["choices"][0]["message"]["content"] == reply.text


def _split_char(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


@pytest.mark.slow  # two FSDP processes, ~18 s: `make test-slow`
def test_fsdp_checkpoints_carry_the_tokenizer_too(wiki_data, tok, tmp_path, monkeypatch):
    """Two processes sharding the model (FSDP2, a DCP checkpoint): rank 0 copies the run's tokenizer
    into the checkpoint, the checksums cover it, and the checkpoint loads alone with it."""
    import subprocess

    from conftest import env, torchrun_cmd

    from gpt2lab.data.tokenizer import for_model
    from gpt2lab.weights.load import load_model

    out = tmp_path / "fsdp"
    proc = subprocess.run(
        torchrun_cmd(
            data=wiki_data,
            out=str(out),
            strategy="fsdp",
            max_steps=2,
            ckpt_interval=2,
            eval_interval=0,
            sample_interval=0,
        ),
        env=env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "strategy  fsdp" in proc.stdout
    ckpt = out / "checkpoints" / "step_000002"
    assert (ckpt / "tokenizer.json").read_text() == tok.text
    assert "tokenizer.json" in json.loads((ckpt / "checksums.json").read_text())
    alone = tmp_path / "alone"
    shutil.copytree(ckpt, alone)
    assert for_model(load_model(str(alone))).identity == tok.identity


# -- what a user may get wrong ------------------------------------------------------------------------
def test_a_vocabulary_not_reached_is_a_warning_with_the_size_reached(tmp_path):
    from tokenizers import Tokenizer

    (tmp_path / "a.txt").write_text("hello world hello world, the same few words again and again")
    with pytest.warns(UserWarning, match=r"the sources gave ([\d,]+) tokens, fewer than the 1,000 asked for") as w:
        marker = train_tokenizer([str(tmp_path / "a.txt")], 1000, str(tmp_path / "tok"), progress=False)
    reached = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json")).get_vocab_size()
    assert 259 < reached == marker["vocab_size"] < 1000
    assert f"gave {reached:,} tokens" in str(w[0].message)


def test_an_empty_source_is_exit_2_in_one_line_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    for src in (str(tmp_path / "empty.txt"), str(tmp_path / "pkg" / "*.py")):
        argv = ["tokenizer", "train", "--source", src, "--vocab-size", "300", "--out", str(tmp_path / "t"), "--quiet"]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.splitlines()[-1]
        assert err.startswith(f"gpt2lab tokenizer train: --source {src}: no text to train on (1 document(s), 0 bytes)")
        assert not (tmp_path / "t").exists()


def test_a_rerun_with_another_tokenizer_is_refused_naming_both(wiki_data, tok):
    from gpt2lab.data.prepare import prepare
    from gpt2lab.data.shards import ShardError

    before = (Path(wiki_data) / "manifest.json").read_bytes()
    was = f"--tokenizer sha256:{tok.identity[:12]}, not --tokenizer GPT-2's BPE"
    with pytest.raises(ShardError, match=f"prepared with {was}; rerun with the same flags to check it"):
        prepare(WIKI, wiki_data, progress=False, workers=1)
    assert (Path(wiki_data) / "manifest.json").read_bytes() == before


def test_tokenizer_json_itself_is_taken_and_a_missing_path_says_which(wiki_data, tok_dir, tmp_path, capsys):
    from gpt2lab.data.prepare import prepare

    out = str(tmp_path / "data")
    prepare(WIKI, out, tokenizer=str(Path(tok_dir) / "tokenizer.json"), progress=False, workers=1)
    for name in ("manifest.json", "tokenizer.json", "val_000000.bin", "train_000000.bin"):
        a, b = Path(out, name).read_bytes(), Path(wiki_data, name).read_bytes()
        assert a == b or name == "manifest.json" and json.loads(a)["tokenizer"] == json.loads(b)["tokenizer"]
    file = Path(tok_dir) / "tokenizer.json"  # the Python API takes the file prepare takes
    assert gpt2lab.get_tokenizer(str(file)).identity == hashlib.sha256(file.read_bytes()).hexdigest()
    argv = ["prepare", "--source", WIKI, "--out", str(tmp_path / "x"), "--tokenizer", str(tmp_path / "nope"), "--quiet"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--tokenizer {tmp_path / 'nope'}: no such directory or file" in err
    (tmp_path / "empty").mkdir()
    assert cli.main([*argv[:-2], str(tmp_path / "empty"), "--quiet"]) == 2
    assert "holds no tokenizer.json (nor GPT-2's vocab.json and merges.txt)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def gpt2_exports(tmp_path_factory) -> list[str]:
    """GPT-2's own vocabulary as others write it: vocab.json + merges.txt (an export of a GPT-2 model, the
    hub's gpt2), and transformers' tokenizer.json of it (save_pretrained)."""
    from transformers import GPT2TokenizerFast

    root = tmp_path_factory.mktemp("gpt2")
    (root / "files").mkdir()
    shutil.copy(tokenizers_mod.asset_path("encoder.json"), root / "files" / "vocab.json")
    shutil.copy(tokenizers_mod.asset_path("vocab.bpe"), root / "files" / "merges.txt")
    hf = GPT2TokenizerFast.from_pretrained(str(root / "files"))
    assert hf("Hello, I'm a language model,").input_ids == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    hf.save_pretrained(str(root / "saved"))
    assert (root / "saved" / "tokenizer.json").is_file()
    return [str(root / "files"), str(root / "saved"), str(root / "saved" / "tokenizer.json")]


def test_a_gpt2_export_is_gpt2s_bpe(gpt2_exports, tok_dir, tmp_path, capsys):
    from gpt2lab.data.prepare import prepare

    prepare(WIKI, str(tmp_path / "ref"), progress=False, workers=1)
    ref = sorted(p.name for p in (tmp_path / "ref").iterdir())
    for i, path in enumerate(gpt2_exports):
        out = tmp_path / f"out{i}"
        assert cli.main(["prepare", "--source", WIKI, "--out", str(out), "--tokenizer", path, "--quiet"]) == 0
        assert sorted(p.name for p in out.iterdir()) == ref  # no tokenizer.json: the manifest says "gpt2"
        assert all((out / n).read_bytes() == (tmp_path / "ref" / n).read_bytes() for n in ref if n != "manifest.json")
        assert json.loads((out / "manifest.json").read_text())["tokenizer"] == "gpt2"
    assert not tokenizers_mod.is_gpt2_vocabulary(tok_dir)
    assert not tokenizers_mod.is_gpt2_vocabulary(str(tmp_path / "ref"))


def test_train_reads_a_glob_of_code_and_says_once_which_files_it_skipped(tmp_path):
    import warnings

    (tmp_path / "src" / "pkg").mkdir(parents=True)
    code = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n"
    (tmp_path / "src" / "pkg" / "m.py").write_text(code)
    (tmp_path / "src" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        marker = train_tokenizer([str(tmp_path / "src")], 300, str(tmp_path / "tok"), progress=False)
    skipped = [str(w.message) for w in caught if "not UTF-8 text" in str(w.message)]
    src = tmp_path / "src"
    assert skipped == [f"directory {src} holds 1 file(s) that are not UTF-8 text, skipped: {src / 'logo.png'}"]
    assert marker["sources"] == [{"source": str(tmp_path / "src"), "bytes": len(code.encode()), "documents": 1}]
    glob = str(tmp_path / "src" / "**" / "*.py")
    assert train_tokenizer([glob], 300, str(tmp_path / "tok"), progress=False)["sources"][0]["documents"] == 1
    nested = tmp_path / "new" / "dir" / "tok"  # its missing parents are made
    assert train_tokenizer([glob], 300, str(nested), progress=False) == json.loads((nested / MARKER).read_text())


def test_an_exports_swapped_tokenizer_json_is_read_as_transformers_reads_it(
    gpt2_vocab_export, gpt2_exports, tok, tok_dir, tmp_path, capsys
):
    """A GPT-2 export whose tokenizer.json was put there by hand: gpt2lab reads the ids AutoTokenizer reads
    (the trained one, or GPT-2's own), and a tokenizer.json it cannot read is exit 1 in one line naming it."""
    import transformers

    from gpt2lab.weights.load import load_model

    text = "The city's 1,234 bridges — naïve 日本 🙂\n    indented"
    for given, identity in ((Path(tok_dir, "tokenizer.json"), tok.identity), (Path(gpt2_exports[2]), None)):
        d = tmp_path / f"swapped{identity is None}"
        shutil.copytree(gpt2_vocab_export[1], d)
        shutil.copy(given, d / "tokenizer.json")
        theirs = transformers.AutoTokenizer.from_pretrained(str(d))(text)["input_ids"]
        assert gpt2lab.get_tokenizer(str(d)).encode(text) == theirs
        assert (theirs == tok.encode(text)) == (identity is not None)
        assert load_model(str(d)).config.tokenizer == identity
        out = tmp_path / f"data{identity is None}"  # prepare --tokenizer reads the same file
        assert cli.main(["prepare", "--source", WIKI, "--out", str(out), "--tokenizer", str(d), "--quiet"]) == 0
        assert json.loads((out / "manifest.json").read_text())["tokenizer"] == (identity or "gpt2")
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(d / "tokenizer.json"))
    assert cli.main(["export", str(d), str(tmp_path / "out")]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert f"SRC {d}: {d}/tokenizer.json: neither GPT-2's BPE nor a tokenizer gpt2lab reads" in line
    assert line.endswith("or export it again") and not (tmp_path / "out").exists(), line
