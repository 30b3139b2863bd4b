"""--strategy (choose_strategy with made-up facts) and --activation-checkpointing, in one process.

The 2-process FSDP run is in test_train_dist.py, beside the DDP one it is compared with.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_gpt

from gpt2lab.distributed.parallel import choose_strategy
from gpt2lab.model.sampling import generate
from gpt2lab.system.runtime import ChoiceError
from gpt2lab.train.config import ConfigError, FinetuneConfig, ParallelConfig, TrainConfig

GiB = 2**30


def test_auto_is_ddp_for_one_process_even_when_fsdp_is_asked():
    for requested in ("auto", "ddp", "fsdp"):
        choice = choose_strategy(
            requested, world_size=1, device_type="cuda", ddp_bytes=100 * GiB, device_bytes=80 * GiB
        )
        assert choice.value == "ddp" and "one process" in choice.reason
    assert "torchrun" in choose_strategy("fsdp", world_size=1, device_type="cpu").reason


def test_auto_shards_what_does_not_fit():
    # gpt2-xl, 1558M parameters: 16 bytes each under DDP = 23.2 GiB of weights, grads and AdamW state
    need = 16 * 1_557_611_200  # DDP's fp32 weight, gradient and two AdamW moments per parameter
    big = choose_strategy(
        "auto", world_size=8, device_type="cuda", dtype="bfloat16", ddp_bytes=need, device_bytes=16 * GiB
    )
    assert big.value == "fsdp" and "23.2 GiB" in big.reason and "8 processes" in big.reason
    fits = choose_strategy(
        "auto", world_size=8, device_type="cuda", dtype="bfloat16", ddp_bytes=need, device_bytes=80 * GiB
    )
    assert fits.value == "ddp" and "fits" in fits.reason
    # the edge: exactly the device's memory still fits (the prediction holds the margins), one byte more does not
    edge = 40 * GiB
    assert (
        choose_strategy("auto", world_size=2, device_type="cuda", ddp_bytes=edge, device_bytes=40 * GiB).value == "ddp"
    )
    assert (
        choose_strategy("auto", world_size=2, device_type="cuda", ddp_bytes=edge + 1, device_bytes=40 * GiB).value
        == "fsdp"
    )


def test_auto_without_a_prediction_or_when_fsdp_cannot_help_is_ddp():
    cpu = choose_strategy("auto", world_size=2, device_type="cpu", ddp_bytes=10 * GiB, device_bytes=None)
    assert cpu.value == "ddp" and "no memory prediction" in cpu.reason
    huge = dict(world_size=4, device_type="cuda", ddp_bytes=100 * GiB, device_bytes=16 * GiB)
    assert choose_strategy("auto", lora=True, **huge).value == "ddp"
    assert choose_strategy("auto", dtype="float16", **huge).value == "ddp"


def test_asked_for_is_kept_or_refused_in_one_line():
    small = dict(world_size=2, device_type="cuda", ddp_bytes=GiB, device_bytes=80 * GiB)
    assert choose_strategy("fsdp", **small).value == "fsdp"  # fits, but asked for
    assert (
        choose_strategy("ddp", world_size=2, device_type="cuda", ddp_bytes=100 * GiB, device_bytes=16 * GiB).value
        == "ddp"
    )  # the user's call, even if it will not fit
    with pytest.raises(ChoiceError, match="--strategy fsdp with float16"):
        choose_strategy("fsdp", dtype="float16", **small)
    with pytest.raises(ChoiceError, match="choose one of auto, ddp, fsdp"):
        choose_strategy("zero3", **small)


def test_config_rejects_unknown_strategy_and_lora_with_fsdp():
    with pytest.raises(ConfigError, match="strategy 'zero1': choose one of auto, ddp, fsdp"):
        ParallelConfig(strategy="zero1")
    with pytest.raises(ConfigError, match="--strategy fsdp with --lora-rank: .*use --strategy ddp"):
        TrainConfig(parallel=ParallelConfig(strategy="fsdp"), finetune=FinetuneConfig(lora_rank=4))
    with pytest.raises(ConfigError, match="--strategy fsdp with --lora-rank: .*use --strategy ddp"):
        TrainConfig.from_dict({"strategy": "fsdp", "lora_rank": 4})  # the flat form, checked the same
    assert TrainConfig.from_dict({"strategy": "ddp", "lora_rank": 4}).parallel.strategy == "ddp"


def _loss_and_grads(model, idx, targets, **kwargs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # the dropout masks
    _, loss = model(idx, targets, **kwargs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("return_logits", [True, False])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(return_logits):
    # dropout on: the recomputed forward must replay the same masks
    model = tiny_gpt(seed=5, n_layer=3, vocab_size=50304, embd_pdrop=0.1, attn_pdrop=0.1, resid_pdrop=0.1).train()
    g = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, 50257, (3, 24), generator=g), torch.randint(0, 50257, (3, 24), generator=g)
    calls = {"n": 0}
    model.transformer.h[1].register_forward_pre_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    loss, grads = _loss_and_grads(model, idx, targets, return_logits=return_logits)
    assert calls["n"] == 1
    model.activation_checkpointing = True
    loss_ac, grads_ac = _loss_and_grads(model, idx, targets, return_logits=return_logits)
    assert calls["n"] == 3  # forward, then the forward again inside backward: it did recompute
    assert abs(loss.item() - loss_ac.item()) <= 1e-6
    assert grads.keys() == grads_ac.keys()
    for name in grads:
        assert torch.allclose(grads[name], grads_ac[name], rtol=0, atol=1e-6), name
    # dropout really was on: another seed gives another loss
    torch.manual_seed(8)
    assert abs(model(idx, targets, return_logits=return_logits)[1].item() - loss.item()) > 1e-4


def test_activation_checkpointing_is_off_outside_training():
    model = tiny_gpt(seed=1, vocab_size=50304)
    model.activation_checkpointing = True
    calls = {"n": 0}
    model.transformer.h[0].register_forward_pre_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    idx = torch.randint(0, 50257, (1, 8))
    with torch.no_grad():
        plain = model(idx)[0]  # eval mode (tiny_gpt): no checkpoint wrapper, no recompute
        cached = generate(model, idx, 3, top_k=1)  # the model itself, not its inference copy
    assert calls["n"] == 1 + 3 and plain.shape == (1, 8, 50304) and cached.shape == (1, 11)


def test_auto_asks_the_planner_what_ddp_needs_on_a_gpu():
    """--strategy auto on GPUs: DDP's per-rank memory comes from memplan.predict for this very run."""
    from gpt2lab.system import runtime
    from gpt2lab.train import memplan
    from gpt2lab.train.gather import MachineFacts
    from gpt2lab.train.plan import strategy_for
    from gpt2lab.train.settings import load_preset

    cfg = load_preset("gpt2-1558m", data="unused", total_batch_tokens=1024 * 16 * 8)
    need = memplan.predict(
        cfg,
        strategy="ddp",
        world_size=8,
        dtype="bfloat16",
        accum=1,
        device="cuda",
        compiled=True,
    ).total
    gpu = runtime.Facts("cuda", "NVIDIA H100 80GB HBM3", cuda_bf16=True)
    for card, expect in ((need, "ddp"), (need - 1, "fsdp")):
        machine = MachineFacts(gpu, world_size=8, device_bytes=card)
        choice = strategy_for(cfg, machine, "bfloat16", accum=1, compiled=True)
        assert choice.value == expect, choice.reason
