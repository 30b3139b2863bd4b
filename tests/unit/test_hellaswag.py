"""HellaSwag scoring vs hand-computed losses and a plain transformers loop; ranks, compile, bad input
(two gloo ranks in real processes: tests/e2e/test_real_processes.py)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from conftest import DATA, argmin, reference_scores

from gpt2lab.data.tokenizer import gpt2_tokenizer
from gpt2lab.evals import download
from gpt2lab.evals import hellaswag as hs
from gpt2lab.evals.hellaswag import Example, evaluate_hellaswag, load_examples, score_examples
from gpt2lab.model.gpt import GPT, GPTConfig

SLICE = str(DATA / "hellaswag_val_200.jsonl")
VOCAB = 50257


@pytest.fixture(scope="module")
def real_examples_ref(hf_ref):
    examples = load_examples(SLICE, limit=100)
    return examples, reference_scores(hf_ref[0], examples)


@pytest.mark.parametrize("strategy, n", [("padded", 100), ("shared", 100)])
def test_agrees_with_transformers_loop_on_real_examples(hf_ref, real_examples_ref, strategy, n):
    from gpt2lab.weights.load import load_model

    examples, ref = real_examples_ref[0][:n], real_examples_ref[1][:n]
    ours = score_examples(load_model(hf_ref[1]), examples, device="cpu", batch_size=16, strategy=strategy)
    assert len(ours) == n
    for ex, s, (sums, means) in zip(examples, ours, ref):
        assert s.sum_loss == pytest.approx(sums, rel=1e-5, abs=1e-4)
        assert s.mean_loss == pytest.approx(means, rel=1e-5, abs=1e-4)
        assert (s.pred, s.pred_norm, s.label) == (argmin(sums), argmin(means), ex.label)
    # Predictions are a real check only if endings are not near ties and not all alike.
    gaps = [sorted(m)[1] - sorted(m)[0] for _, m in ref]
    assert sorted(gaps)[len(gaps) // 10] > 1e-2
    assert len({s.pred_norm for s in ours}) == 4


def _constant_logits_model(favoured: int, s: float) -> GPT:
    """Every position outputs logit s for token ``favoured`` and 0 for all others: blocks
    are zeroed (the residual stream passes through), ln_f keeps only its bias e_0, and
    wte (tied to lm_head) is zero except row ``favoured`` = s * e_0."""
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=64, vocab_size=VOCAB)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.transformer.wte.weight[favoured, 0] = s
    return model


@pytest.mark.parametrize("strategy", ["padded", "shared"])
def test_hand_built_example_known_from_logits(tmp_path, strategy):
    enc = gpt2_tokenizer()
    yes, the = enc.encode(" yes"), enc.encode(" the")
    assert len(yes) == len(the) == 1 and enc.encode(" yes yes yes the") == yes * 3 + the
    s = 12.0
    model = _constant_logits_model(yes[0], s)
    l_yes = math.log(math.exp(s) + VOCAB - 1) - s  # cross entropy of the favoured token
    l_other = math.log(math.exp(s) + VOCAB - 1)
    endings = ["the", "yes yes yes the", "yes the", "the the"]
    sums = [l_other, 3 * l_yes + l_other, l_yes + l_other, 2 * l_other]
    means = [l_other, (3 * l_yes + l_other) / 4, (l_yes + l_other) / 2, l_other]
    # Summed loss favours the shortest ending (0), mean loss the one with most " yes" (1).
    examples = [Example("The answer is", tuple(endings), 1), Example("So we say", tuple(endings), 0)]
    scores = score_examples(model, examples, device="cpu", batch_size=2, strategy=strategy)
    for sc in scores:
        # float32 log-sum-exp over 50257 logits: about 1e-5 relative
        assert sc.sum_loss == pytest.approx(sums, rel=1e-4)
        assert sc.mean_loss == pytest.approx(means, rel=1e-4)
        assert (sc.pred, sc.pred_norm) == (0, 1)
    path = tmp_path / "two.jsonl"
    path.write_text(
        "".join(json.dumps({"ctx": e.ctx, "endings": list(e.endings), "label": e.label}) + "\n" for e in examples)
    )
    res = evaluate_hellaswag(model, str(path), device="cpu", strategy=strategy)
    assert res == {"task": "hellaswag", "n": 2, "acc": 0.5, "acc_norm": 0.5}


def test_shared_passes_and_one_token_endings_agree_with_transformers(hf_ref, real_examples_ref):
    """Nine examples with one context: 'shared' splits their 36 ending rows into passes
    of similar length; one example has only one-token endings (no ending pass at all)."""
    from gpt2lab.weights.load import load_model

    model, d = hf_ref
    real = real_examples_ref[0]
    examples = [Example(real[0].ctx, ex.endings, ex.label) for ex in real[:8]]
    examples.append(Example(real[0].ctx, ("yes", "no", "the", "a"), 2))
    ref = reference_scores(model, examples)
    for strategy in ("shared", "padded"):
        ours = score_examples(load_model(d), examples, device="cpu", batch_size=16, strategy=strategy)
        for s, (sums, means) in zip(ours, ref):
            assert s.sum_loss == pytest.approx(sums, rel=1e-5, abs=1e-4)
            assert s.mean_loss == pytest.approx(means, rel=1e-5, abs=1e-4)


@torch.no_grad()
def test_forward_positions_equal_full_logits_there():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=100)).eval()
    idx = torch.randint(0, 100, (3, 10))
    full, _ = model(idx)
    positions = torch.tensor([0, 9, 13, 29, 21])  # flat: row b, position t is b * 10 + t
    logits, loss = model(idx, idx, positions=positions)
    assert logits.shape == (5, 100)
    assert torch.allclose(logits, full.reshape(30, 100)[positions], atol=1e-5)
    expected = torch.nn.functional.cross_entropy(logits, idx.reshape(-1)[positions])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    with pytest.raises(ValueError, match="not both"):
        model(idx, last_only=True, positions=positions)


def test_auto_strategy():
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=16, vocab_size=32))
    assert hs.resolve_strategy("auto", model, "cpu") == "shared"
    assert hs.resolve_strategy("auto", model, "cuda") == "padded"
    compiled = torch.compile(model)  # wrapping only: nothing is compiled until it runs
    assert hs.resolve_strategy("auto", compiled, "cpu") == "padded"
    with pytest.raises(ValueError, match="use 'padded' with a compiled model"):
        hs.resolve_strategy("shared", compiled, "cpu")
    with pytest.raises(ValueError, match="strategy must be one of auto, padded, shared"):
        hs.resolve_strategy("fast", model, "cpu")


def test_bfloat16_autocast_close_to_float32(hf_ref):
    from gpt2lab.weights.load import load_model

    _, d = hf_ref
    model = load_model(d)
    examples = load_examples(SLICE, limit=8)
    f32 = score_examples(model, examples, device="cpu", batch_size=8)
    bf16 = score_examples(model, examples, device="cpu", batch_size=8, dtype="bfloat16")
    for a, b in zip(f32, bf16):
        assert b.mean_loss == pytest.approx(a.mean_loss, rel=0.05)


# ------------------------------------------------------------------ data


def _write(tmp_path, lines: list[str]) -> str:
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


GOOD = json.dumps({"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 2})


def test_load_examples_reads_slice_and_limit():
    examples = load_examples(SLICE)
    assert len(examples) == 200
    assert examples[0].endings[3] == "starts pulling up roofing on a roof." and examples[0].label == 3
    assert len(load_examples(SLICE, limit=7)) == 7


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"ctx": "A", "endings": ["a", "b"', ":3: not valid JSON"),
        (json.dumps({"ctx": "A", "endings": ["a", "b", "c", "d"], "label": 4}), ":3: 'label' must be an integer 0-3"),
        (json.dumps({"ctx": "A", "endings": ["a", "b", "c"], "label": 0}), ":3: 'endings' must be a list of 4"),
        (json.dumps({"endings": ["a", "b", "c", "d"], "label": 0}), ":3: 'ctx' must be a non-empty string"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, bad, message):
    path = _write(tmp_path, [GOOD, GOOD, bad])
    with pytest.raises(ValueError) as e:
        load_examples(path)
    assert path + message in str(e.value)


def test_missing_file_and_string_label(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl.*--data"):
        load_examples(str(tmp_path / "nope.jsonl"))
    path = _write(tmp_path, [json.dumps({"ctx": "A", "endings": ["a", "b", "c", "d"], "label": "1"})])
    assert load_examples(path)[0].label == 1  # the HF dataset's labels are strings


def _fail(ds, out):
    raise OSError("network is unreachable")


def test_official_file_no_network_no_cache_says_pass_data(tmp_path, monkeypatch):
    import urllib.error
    import urllib.request

    def unreachable(url, timeout=None):
        raise urllib.error.URLError(OSError(101, "Network is unreachable"))

    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path))
    monkeypatch.setattr(urllib.request, "urlopen", unreachable)
    monkeypatch.setattr(download, "from_hub", _fail)
    with pytest.raises(RuntimeError, match="pass --data FILE") as e:
        load_examples()
    assert hs.HELLASWAG_URL in str(e.value) and "\n" not in str(e.value)  # one line naming the URL
    assert not any(p.is_file() for p in tmp_path.rglob("*"))  # no half-written cache


def test_official_file_downloaded_once_then_cached(tmp_path, monkeypatch):
    """evals/download.py's one fetch, from a file:// URL (urllib reads it as it reads https)."""
    import urllib.request

    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hs, "HELLASWAG_URL", (DATA / "hellaswag_val_200.jsonl").resolve().as_uri())
    monkeypatch.setattr(download, "from_hub", _fail)
    calls, urlopen = [], urllib.request.urlopen
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout=None: (calls.append(url), urlopen(url))[1])
    assert len(load_examples(limit=5)) == 5
    assert len(load_examples()) == 200 and calls == [hs.HELLASWAG_URL]  # the second call did not fetch
    cached = tmp_path / "cache" / "hellaswag" / "hellaswag_val.jsonl"
    assert cached.read_bytes() == (DATA / "hellaswag_val_200.jsonl").read_bytes()
    assert os.listdir(cached.parent) == ["hellaswag_val.jsonl"]  # no temporary left beside it
