"""The chunked training loss equals the plain cross entropy over materialised logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpt2lab.model.loss as model_mod
from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.model.loss import LossPath, choose_loss


def _case(vocab=300, n=70, c=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g, requires_grad=True)
    w = (0.3 * torch.randn(vocab, c, generator=g)).requires_grad_()
    t = torch.randint(0, vocab, (n,), generator=g)
    t[3:9] = -1  # ignored positions
    return x, w, t


@pytest.mark.parametrize(
    "chunk_elements, group_elements, compiled",
    [
        (300 * 7, 2**28, False),  # several chunks, the last one ragged
        (300 * 8, 300 * 16, False),  # several groups for grad_w
        (2**24, 2**28, False),  # one chunk
        (300 * 16, 300 * 32, True),  # the torch.compile'd kernel (the --compile true path)
    ],
)
def test_chunked_loss_and_grads_match_cross_entropy(monkeypatch, chunk_elements, group_elements, compiled):
    monkeypatch.setattr(model_mod, "_CHUNK_ELEMENTS", chunk_elements)
    monkeypatch.setattr(model_mod, "_GROUP_ELEMENTS", group_elements)
    x, w, t = _case()
    ref = F.cross_entropy(x @ w.t(), t, ignore_index=-1)
    gx_ref, gw_ref = torch.autograd.grad(ref, (x, w))
    loss = model_mod.chunked_cross_entropy(x, w, t, compiled=compiled)
    gx, gw = torch.autograd.grad(loss * 3.0, (x, w))  # a non-unit upstream gradient
    assert abs(loss.item() - ref.item()) < 1e-5
    assert torch.allclose(gx, 3 * gx_ref, atol=1e-6) and torch.allclose(gw, 3 * gw_ref, atol=1e-6)
    with torch.no_grad():  # evaluation path
        assert abs(model_mod.chunked_cross_entropy(x, w, t).item() - ref.item()) < 1e-5


def test_underflowed_target_probability_is_exact():
    x, w, t = _case(vocab=50, n=4, c=8)
    w = w.detach().clone()
    # row 0: token 7 sits 120 logits below token 5, so its fp32 softmax probability underflows to 0
    w[7] = -60 * x[0].detach() / x[0].detach().norm() ** 2
    w[5] = 60 * x[0].detach() / x[0].detach().norm() ** 2
    t = torch.tensor([7, 1, 2, 3])
    ref = F.cross_entropy(x.detach() @ w.t(), t)
    with torch.enable_grad():
        loss = model_mod.chunked_cross_entropy(x, w.requires_grad_(), t)
    assert ref.item() > 25 and abs(loss.item() - ref.item()) < 1e-4


def test_bf16_autocast_matches_the_autocast_reference():
    x, w, t = _case(vocab=2000, n=64, c=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy((x @ w.t()).float(), t, ignore_index=-1)
        loss = model_mod.chunked_cross_entropy(x, w, t)
    (gw_ref,) = torch.autograd.grad(ref, (w,))
    (gw,) = torch.autograd.grad(loss, (w,))
    assert abs(loss.item() - ref.item()) < 1e-3  # both from the same bf16 logits
    assert (gw - gw_ref).abs().max() < 0.02 * gw_ref.abs().max()


def test_model_training_path_equals_logits_path():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=512, n_layer=2, n_head=2, n_embd=32))
    x, y = torch.randint(0, 512, (3, 32)), torch.randint(0, 512, (3, 32))
    _, ref = model(x, y)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    logits, loss = model(x, y, return_logits=False)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert logits is None and abs(loss.item() - ref.item()) < 1e-5
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-6)


def test_unchunked_training_path_returns_the_same_loss_without_logits():
    """chunked_loss False (a compiled model on a GPU): logits + F.cross_entropy, logits not returned."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=512, n_layer=1, n_head=2, n_embd=16))
    x, y = torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))
    _, chunked = model(x, y, return_logits=False)
    model.set_loss(LossPath(chunked=False))
    logits, plain = model(x, y, return_logits=False)
    ref = F.cross_entropy(model(x)[0].view(-1, 512), y.view(-1))
    assert logits is None and abs(plain.item() - ref.item()) < 1e-6 and abs(chunked.item() - ref.item()) < 1e-5


@pytest.mark.parametrize(
    "device,compiled,expect",
    [
        ("cuda", True, (True, False)),
        ("cuda", False, (False, True)),
        ("cpu", True, (True, True)),
        ("cpu", False, (False, True)),
        ("mps", True, (True, True)),
    ],
)
def test_loss_settings_by_device(device, compiled, expect):
    path = choose_loss(torch.device(device).type, compiled)  # (its kernel compiled, chunked)
    assert (path.compiled, path.chunked) == expect


def test_fp16_logit_gradients_do_not_underflow(monkeypatch):
    # The compiled kernel's maths (1/n applied inside) run eagerly, to skip a compile here.
    # At n = 16384 rows, p/n of the non-target tokens falls below fp16's normal range; the
    # reference is what fp16 autocast gives with a GradScaler, against fp32 maths.
    monkeypatch.setattr(model_mod, "_kernel", lambda compiled: (model_mod._softmax_grad, True))
    g = torch.Generator().manual_seed(0)
    n, c, vocab = 16384, 16, 256
    x = torch.randn(n, c, generator=g, requires_grad=True)
    w = torch.randn(vocab, c, generator=g, requires_grad=True)
    t = torch.randint(0, vocab // 2, (n,), generator=g)  # rows vocab//2.. get only the p terms
    x16, w16 = (a.detach().half().float().requires_grad_() for a in (x, w))
    (exact,) = torch.autograd.grad(F.cross_entropy(x16 @ w16.t(), t), (w16,))
    with torch.autocast("cpu", dtype=torch.float16):
        scaled = F.cross_entropy((x @ w.t()).float(), t) * 65536.0
    (ref,) = torch.autograd.grad(scaled, (w,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model_mod.chunked_cross_entropy(x, w, t, compiled=True)
    (gw,) = torch.autograd.grad(loss * 65536.0, (w,))  # the scaler's scale reaches us only here
    rows = slice(vocab // 2, vocab)
    ref_err = ((ref[rows] / 65536 - exact[rows]).norm() / exact[rows].norm()).item()
    err = ((gw[rows] / 65536 - exact[rows]).norm() / exact[rows].norm()).item()
    assert err < 2 * ref_err, (err, ref_err)
