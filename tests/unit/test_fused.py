"""inference/fused.py: the fused decode step (``_gemv.block_step``) against the model's own block on the same
held weights, through both caches the model decodes with (KVCache, the server's RowsCache), and the calls
it must leave to the model's code."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import tiny_gpt

from gpt2lab.inference.choice import Candidate
from gpt2lab.inference.form import hold
from gpt2lab.inference.fused import FusedDecodeBlock, fusable
from gpt2lab.inference.kernels import gemv_error
from gpt2lab.model.gpt import Block
from gpt2lab.serve.batch import RowsCache

WHY_NOT = gemv_error(torch.device("cpu"))
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))
CANDS = [Candidate("float32", "int8-gemv"), Candidate("bfloat16", "gemv")]


@pytest.fixture
def counted(monkeypatch):
    """The number of fused block calls made while the test runs."""
    from gpt2lab.inference import _gemv

    calls = []
    step = _gemv.block_step
    monkeypatch.setattr(_gemv, "block_step", lambda *a: (calls.append(a), step(*a))[1])
    return calls


def _unfused(model):
    """The same held model with its blocks' own forward (the class swap undone)."""
    for m in model.modules():
        if isinstance(m, FusedDecodeBlock):
            m.__class__ = Block
    return model


@pytest.mark.parametrize("cand", CANDS, ids=str)
@pytest.mark.parametrize("shape", [dict(n_head=2, n_embd=32), dict(n_head=3, n_embd=36, bias=False)], ids=["32", "36"])
@pytest.mark.parametrize("rows", [1, 6])  # six: a group of four rows through each widened weight row, two left
def test_one_token_fused_equals_the_blocks_own_forward_with_the_same_cache(cand, shape, rows, counted):
    """Logits and the KV cache after several one-token steps, fused against unfused, from the same prompt
    (36 wide: heads of 12, not a multiple of 8; no biases)."""
    model = tiny_gpt(seed=5, vocab_size=97, block_size=40, **shape)
    idx = torch.randint(0, 97, (rows, 30), generator=torch.Generator().manual_seed(3))
    outs, caches = [], []
    for fused in (True, False):
        ready = hold(model, cand)
        if not fused:
            _unfused(ready)
        cache = ready.new_kv_cache(40)
        with torch.inference_mode():
            ready(idx[:, :9], kv_cache=cache)
            outs.append(torch.cat([ready(idx[:, t : t + 1], kv_cache=cache)[0] for t in range(9, 30)], dim=1))
        caches.append(cache)
    assert len(counted) == 21 * model.config.n_layer
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        torch.testing.assert_close(a[:, :, :30], b[:, :, :30], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cand", CANDS, ids=str)
def test_the_servers_rows_each_at_its_own_position(cand, counted):
    """The server's RowsCache: two rows of different lengths in one fused step, then the first alone (its
    slot 0); every row's logits those of its sequence run whole."""
    model = tiny_gpt(seed=6, vocab_size=97, block_size=40)
    ready = hold(model, cand, rows=2)
    idx = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        whole, _ = ready(idx)
        rows = RowsCache(model.config.n_layer, 40)
        for slot, n in enumerate((7, 10)):  # two prompts of different lengths
            cache = ready.new_kv_cache(40)
            ready(idx[slot : slot + 1, :n], kv_cache=cache)
            rows.put(slot, cache, capacity=2)
        assert counted == []  # the prompts: the model's code
        both, _ = ready(torch.stack([idx[0, 7:8], idx[1, 10:11]]), kv_cache=rows.view(torch.device("cpu")))
        rows.remove(1)
        alone, _ = ready(idx[:1, 8:9], kv_cache=rows.view(torch.device("cpu")))
    assert len(counted) == 2 * model.config.n_layer
    torch.testing.assert_close(both[:, 0], torch.stack([whole[0, 7], whole[1, 10]]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(alone[0, 0], whole[0, 8], rtol=1e-4, atol=1e-4)


def test_what_it_leaves_to_the_model(counted):
    """The modern block is not fusable; a prompt, training and a gradient-tracking input run the model's
    code; the fused step changes no tensor the caller holds."""
    assert not any(fusable(b) for b in hold(tiny_gpt(seed=1, norm="rmsnorm"), CANDS[0]).transformer.h)
    assert not any(fusable(b) for b in hold(tiny_gpt(seed=1), Candidate("float32", "plain")).transformer.h)
    ready = hold(tiny_gpt(seed=2, vocab_size=97), CANDS[0])
    block = ready.transformer.h[0]
    assert isinstance(block, FusedDecodeBlock)
    cache = ready.new_kv_cache(20)
    with torch.no_grad():
        ready(torch.tensor([[1, 2, 3]]), kv_cache=cache)  # the prompt
    assert counted == []
    x = torch.randn(1, 1, 32, requires_grad=True)
    y = block(x, cache)  # gradient wanted: the model's code, which autograd follows
    y.sum().backward()
    assert counted == [] and x.grad is not None
    with torch.no_grad():
        x0 = x.detach().clone()
        block(x.detach(), cache)
        assert len(counted) == 1 and torch.equal(x.detach(), x0)
        block.train()
        block(x.detach(), cache)
        block.eval()
        assert len(counted) == 1
        block.ln_1.double()  # norms cast after holding (a model's .to()): the model's code, not the kernel
        with contextlib.suppress(RuntimeError):  # which may refuse the mix of dtypes; the kernel would misread it
            block(x.detach(), cache)
        assert len(counted) == 1
