"""GPU-only checks (skipped without CUDA): run them on a machine with a GPU.

bf16 autocast stays close to fp32, torch.compile matches eager, and KV-cached greedy
sampling matches the uncached loop, all on the device where users train.
"""

import pytest
import torch

from gpt2lab import GPT, GPTConfig
from gpt2lab.model.sampling import generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _model(vocab: int = 50304) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=256, vocab_size=vocab, token_vocab_size=50257)
    return GPT(cfg).cuda().eval()


def test_bf16_autocast_logits_close_to_fp32():
    model = _model()
    idx = torch.randint(0, 50257, (4, 128), device="cuda")
    with torch.no_grad():
        ref, _ = model(idx)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            low, _ = model(idx)
    # bf16 keeps 8 mantissa bits: relative error per logit ~1e-2 of the logit scale.
    err = (low.float() - ref).abs().max().item()
    assert err < 0.05 * ref.abs().max().item(), err
    agree = (low.float().argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree > 0.95


def test_compiled_equals_eager():
    model = _model()
    idx = torch.randint(0, 50257, (2, 64), device="cuda")
    targets = torch.randint(0, 50257, (2, 64), device="cuda")
    with torch.no_grad():
        ref, ref_loss = model(idx, targets)
        compiled = torch.compile(model)
        out, loss = compiled(idx, targets)
    assert (out - ref).abs().max().item() < 1e-3
    assert abs(loss.item() - ref_loss.item()) < 1e-4


def test_kv_cache_greedy_equals_no_cache_on_gpu():
    model = _model()
    idx = torch.randint(0, 50257, (3, 16), device="cuda")
    a = generate(model, idx, 48, temperature=0, use_cache=True)
    b = generate(model, idx, 48, temperature=0, use_cache=False)
    assert torch.equal(a, b)


def test_a_step_judged_bad_on_the_gpu_is_skipped_there():
    """The trainer's checks on the device: the guard's verdict, computed on the GPU, makes fused
    AdamW skip the step in its kernel (weights and state untouched); a healthy verdict steps."""
    from gpt2lab.train.config import TrainConfig
    from gpt2lab.train.optim import AdamW
    from gpt2lab.train.spikes import SpikeGuard

    spike = dict(spike_window=4, spike_loss_z=4.0, spike_norm_z=6.0, spike_rollback=3)
    guard = SpikeGuard(TrainConfig().with_values(**spike), torch.device("cuda"))
    p = torch.nn.Parameter(torch.randn(64, 64, device="cuda"))
    opt = AdamW([p], lr=1e-2, fused=True)
    for loss in (5.0, 5.1, 4.9, 5.0, float("nan"), 9.0, 5.0):
        p.grad = torch.randn_like(p)
        before = p.detach().clone()
        opt.step(skip=guard.judge(torch.tensor(loss, device="cuda"), p.grad.norm())[2])
        skipped = torch.equal(before, p.detach())
        assert skipped == (loss != loss or loss == 9.0), loss  # NaN, then a spike (z > 4 over the window)


def test_bf16_decoding_with_a_kv_cache_runs_without_cudnn_attention():
    """A held bf16 model's steps with a cache never reach cuDNN's attention (a plan built per new key
    length: milliseconds of host time each, docs/benchmarks.md); a call without a cache may."""
    model = _model().to(torch.bfloat16)
    idx = torch.randint(0, 50257, (1, 16), device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        a = generate(model, idx, 24, temperature=0, use_cache=True)
    assert a.shape == (1, 40) and not [e.key for e in prof.key_averages() if "cudnn_attention" in e.key]
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the process's flag as it was


def test_bench_memory_searches_on_the_gpu():
    """Its batches are made on the GPU: the trainer's micro-step pins CPU batches only."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "gpt2lab", "bench", "memory", "--size", "124M", "--max-batch", "2", "--seq-len", "128"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert rec["device"] == "cuda" and rec["largest_micro_batch"] == 2
