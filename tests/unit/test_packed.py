"""inference/packed.py: oneDNN-prepacked linears against F.linear and the unpacked model, and the
kernel choice in every branch with faked facts."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_gpt
from gpt2lab.inference.packed import (ONE_ROW_SLACK, LinearFacts, PackedLinear, choose_linear, pack_linears,
                                      packing_available)

needs_onednn = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN packed linear")


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 24), (5, 24), (3, 7, 24)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g) if bias else None
    x = torch.randn(*shape, generator=g)
    layer = PackedLinear(w, b, batch_hint=8)
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (*shape[:-1], 40)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("block", [{}, dict(pos_emb="rotary", norm="rmsnorm", qk_norm=True, mlp_act="relu2",
                                            tie_embeddings=False, logit_softcap=15.0)], ids=["gpt2", "modern"])
def test_a_packed_model_gives_the_models_logits_and_keeps_its_embedding(block):
    model = tiny_gpt(seed=3, vocab_size=97, block_size=32, **block)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    idx = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, _ = model(idx)
        wte = model.transformer.wte.weight.clone()
        assert pack_linears(model, batch_hint=4) == n_linear
        assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
        got, _ = model(idx)
        cache = model.new_kv_cache(16)  # decoding through the KV cache, one token at a time
        model(idx[:1, :10], kv_cache=cache)
        last, _ = model(idx[:1, 10:], kv_cache=cache, last_only=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last[0, -1], want[0, -1], rtol=1e-5, atol=1e-5)
    assert torch.equal(model.transformer.wte.weight, wte)  # the embedding still reads the shared table


CPU = dict(device_type="cpu", dtype="float32", available=True, rows=16)


@pytest.mark.parametrize("facts, requested, value, needle", [
    (dict(CPU, plain_ms=(7.2, 29.1), packed_ms=(7.3, 14.3)), "auto", "packed", "measured faster"),
    (dict(CPU, plain_ms=(7.2, 12.0), packed_ms=(7.0, 14.3)), "auto", "plain", "no faster"),  # slower at a batch
    (dict(CPU, plain_ms=(5.0, 29.1), packed_ms=(5.0 * ONE_ROW_SLACK + 0.1, 14.3)), "auto", "plain", "no faster"),
    (dict(CPU), "auto", "plain", "not measured"),
    (dict(CPU, plain_ms=(7.2, 12.0), packed_ms=(7.0, 14.3)), "packed", "packed", "asked for"),
    (dict(CPU, plain_ms=(7.2, 29.1), packed_ms=(7.3, 14.3)), "plain", "plain", "asked for"),
    (dict(CPU, device_type="cuda"), "auto", "plain", "cuda"),
    (dict(CPU, device_type="mps"), "plain", "plain", "mps"),
    (dict(CPU, dtype="bfloat16"), "auto", "plain", "fp32"),
    (dict(CPU, available=False), "auto", "plain", "no oneDNN"),
])
def test_choose_linear_in_every_branch(facts, requested, value, needle):
    choice = choose_linear(requested, LinearFacts(**facts))
    assert choice.value == value and needle in choice.reason


@pytest.mark.parametrize("facts", [dict(CPU, device_type="cuda"), dict(CPU, dtype="float16"),
                                   dict(CPU, available=False)])
def test_packed_where_it_cannot_run_is_refused_naming_why(facts):
    with pytest.raises(ValueError, match="--cpu-linear packed cannot run here"):
        choose_linear("packed", LinearFacts(**facts))


@needs_onednn
def test_decide_measures_on_the_models_own_weights_and_records_the_times():
    from gpt2lab.inference.packed import decide

    model = tiny_gpt(seed=0, vocab_size=97, block_size=16)
    choice = decide(model, "auto", torch.device("cpu"), "float32", rows=4)
    assert choice.value in ("packed", "plain") and "1 / 4 rows: packed" in choice.reason
    times = [float(t) for t in __import__("re").findall(r"(\d+\.\d+) ms", choice.reason)]
    assert len(times) == 2 and all(t > 0 for t in times)
    assert decide(model, "auto", torch.device("cpu"), "bfloat16", rows=4).reason == "dtype bfloat16: the packed path is fp32"


def test_auto_keeps_the_plain_kernel_when_the_packed_one_fails_here(monkeypatch):
    from gpt2lab.inference import packed

    def broken(*args, **kwargs):
        raise RuntimeError("could not create a primitive descriptor\nmore")

    monkeypatch.setattr(packed, "packing_available", lambda: True)
    monkeypatch.setattr(packed, "probe", broken)
    choice = packed.decide(tiny_gpt(seed=0, vocab_size=97, block_size=16), "auto", torch.device("cpu"), "float32", 4)
    assert choice == packed.LinearChoice(
        "plain", "the packed linear failed on this machine (could not create a primitive descriptor)")
