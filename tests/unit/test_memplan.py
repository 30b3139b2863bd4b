"""The memory planner (gpt2lab.distributed.memplan) and `gpt2lab bench memory`: hand-derived byte counts,
the saved tensors of a real Block, the profiler's record of a real CPU step, the plan, the
presets' stated assumptions."""

from __future__ import annotations

import itertools
import json
import re
from importlib import resources

import pytest
import torch

from gpt2lab import cli
from gpt2lab.benchmarks.memory import model_config
from gpt2lab.distributed import memplan
from gpt2lab.distributed.parallel import choose_strategy
from gpt2lab.model import loss as chunked
from gpt2lab.model.config import MLP_ACTS, NORMS, POS_EMB
from gpt2lab.model.gpt import GPT, Block, GPTConfig, rotary_cos_sin
from gpt2lab.train.settings import load_preset

N_124M = 124_475_904  # GPT-2 124M with the vocab padded to 50304 (nanoGPT's printed count)


def test_param_count_matches_the_model_and_the_known_124m_figure():
    assert memplan.param_counts(model_config("124M", 1024))["total"] == N_124M
    tiny = GPTConfig(n_layer=2, n_head=2, n_embd=48, vocab_size=300, block_size=16)
    assert memplan.param_counts(tiny)["total"] == GPT(tiny).num_params()


def test_state_bytes_ddp_16_per_param_fsdp_sharded():
    cfg = model_config("124M", 1024)
    state = ("weights", "grads", "optimizer")

    def phase(name, **kw):
        return next(p for p in memplan.phases(cfg, micro_batch=1, **kw) if p.phase == name).terms

    ddp = phase("step", strategy="ddp", world_size=2)
    assert sum(ddp[k] for k in state) == 16 * N_124M  # fp32 weights, grads, two AdamW moments
    assert ddp["comm_buffers"] == 4 * N_124M  # DDP's buckets: one more fp32 copy of the grads
    assert phase("step", world_size=1)["comm_buffers"] == 0
    fsdp = phase("step", strategy="fsdp", world_size=2)
    assert sum(fsdp[k] for k in state) == 8 * N_124M and fsdp["comm_buffers"] == 0
    # one micro-step: the root in fp32 (wte 50304x768, wpe 1024x768, ln_f) and two blocks
    # (7,087,872 parameters each) in bf16 in flight; accumulating: every block stays gathered
    # and the whole gradient is kept in fp32 until the last micro-step reduces it
    one = phase("forward", strategy="fsdp", world_size=2, accum=1)
    assert one["weight_copies"] == 4 * 39_421_440 + 2 * 2 * 7_087_872 and one["grads"] == 0
    acc = phase("forward", strategy="fsdp", world_size=2, accum=4)
    assert acc["weight_copies"] == 4 * 39_421_440 + 12 * 2 * 7_087_872 and acc["grads"] == 4 * N_124M
    # DDP under bf16 autocast: the cached bf16 casts of the 12 blocks' Linear weights and biases
    assert phase("forward", world_size=2)["weight_copies"] == 12 * 2 * (12 * 768**2 + 9 * 768)
    pred = memplan.predict(cfg, device="cuda", micro_batch=1)
    assert pred.terms["runtime"] == memplan.CUDA_RUNTIME_BYTES and pred.total == sum(pred.terms.values())


SWITCHES = list(itertools.product(POS_EMB, NORMS, (False, True), MLP_ACTS))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "pos_emb,norm,qk_norm,mlp_act",
    SWITCHES,
    ids=["-".join(map(str, s)).replace("True", "qk").replace("False", "noqk") for s in SWITCHES],
)
def test_block_saved_bytes_equal_what_autograd_keeps(pos_emb, norm, qk_norm, mlp_act, dtype):
    """Every tensor a real Block saves for backward (CPU), by storage, against the planner.

    Exact, and so tied to torch internals the planner's docstring names, checked on torch 2.13
    only (the one installed; 2.11, also supported, was not run): CPU's RMSNorm being aten's
    decomposition (rms_norm_composite: it keeps the normalised input for the gain, and returns a
    contiguous result, whence the copy before c_proj with qk_norm; 2.13 has no CPU kernel for
    aten::_fused_rms_norm), SDPA's output laid out like q, elementwise ops keeping their input's
    layout (the rotated q). A torch whose kernels differ there fails here first."""
    C, B, T, nh = 48, 3, 10, 4  # head size 12: no size equals another, per-token terms apart from per-(T, hs)
    cfg = GPTConfig(
        n_layer=1,
        n_head=nh,
        n_embd=C,
        vocab_size=64,
        block_size=T,
        pos_emb=pos_emb,
        norm=norm,
        qk_norm=qk_norm,
        mlp_act=mlp_act,
    )
    block = Block(cfg, 0)
    x = torch.randn(B, T, C, requires_grad=True)
    # rotary: the fp32 tables GPT.forward builds once for all blocks; the planner counts them with
    # the head (``phases``), so here they are left out like the parameters
    rope = rotary_cos_sin(cfg, torch.arange(T)) if pos_emb == "rotary" else None
    shared = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *(rope or ()))}
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            block(x, None, rope)
    activations = sum(n for ptr, n in saved.items() if ptr not in shared)
    act = 4 if dtype is None else 2
    casts = 0 if dtype is None else 2 * 12 * C * C  # autocast's bf16 copies of the four weight matrices
    assert activations == memplan.block_saved_bytes(cfg, B, T, act, device="cpu") + casts


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch.backends.mkldnn.flags' own
@pytest.mark.parametrize("softcap", [0.0, 15.0], ids=["nocap", "softcap"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N,V,C", [(1000, 500, 16), (100, 2000, 8), (300, 1000, 32), (17, 1000, 64), (40, 300, 200)])
def test_loss_workspace_is_the_peak_of_the_chunked_loss(monkeypatch, N, V, C, dtype, softcap):
    """The peak of live tensor bytes in chunked_cross_entropy's forward, from the profiler's record of
    every allocation, against the planner's replay of its loop. Chunks shrunk so that the shapes
    have several chunks per group and several groups (N=1000, V=500: 32 rows a chunk, 64 a group,
    16 groups), a peak inside the kernel (V=2000, C=8), a partial last chunk, one group, and a peak at
    the grad_w matmul (C=200). oneDNN is off for the count: on CPUs with native bf16 its bf16 matmuls
    take scratch memory of their own through torch's allocator, which differs by CPU (a 2-core AMD
    EPYC Zen 4: 8-104 KB more at these shapes, none with its ISA capped at AVX2), and which the
    planner's replay of the loop's own tensors does not hold."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(chunked, "_CHUNK_ELEMENTS", 2**14)
    monkeypatch.setattr(chunked, "_GROUP_ELEMENTS", 2**15)
    torch.manual_seed(0)
    x, w = torch.randn(N, C, requires_grad=True), torch.randn(V, C, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    with (
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
        torch.backends.mkldnn.flags(enabled=False),
    ):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
            chunked.chunked_cross_entropy(x, w, targets, softcap=softcap)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    predicted = memplan.loss_workspace_bytes(N, V, C, 4 if dtype is None else 2, 4, 4, softcap)
    rows, _ = chunked.chunk_rows(V)
    # left out: a chunk's per-row vectors (the target's probability, nll, masks) and scalars
    assert 0 <= peak - predicted <= 16 * rows, (peak, predicted)


def test_plan_is_the_largest_micro_batch_that_fits():
    cfg = model_config("350M", 1024)
    budget = 40 * 2**30
    rows = {
        (r["strategy"], r["activation_checkpointing"]): r
        for r in memplan.largest_micro_batches(budget, cfg, world_size=8)
    }
    for (strategy, ac), r in rows.items():
        B = r["micro_batch"]

        def total(b):
            return memplan.predict(
                cfg, strategy=strategy, world_size=8, micro_batch=b, activation_checkpointing=ac, compiled=True
            ).total  # plan's default

        assert B >= 1 and total(B) <= budget < total(B + 1) and r["predicted_bytes"] == total(B)
    assert rows[("ddp", True)]["micro_batch"] > rows[("ddp", False)]["micro_batch"]
    assert rows[("fsdp", False)]["micro_batch"] > rows[("ddp", False)]["micro_batch"]
    assert all(r["micro_batch"] == 0 for r in memplan.largest_micro_batches(2**30, cfg))  # nothing fits 1 GiB


def test_bench_plan_and_bad_values(capsys):
    assert cli.main(["bench", "memory", "--size", "774M", "--plan", "40", "--world-size", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    expect = memplan.largest_micro_batches(40 * 2**30, model_config("774M", 1024), world_size=8)
    assert [(r["strategy"], r["activation_checkpointing"], r["micro_batch"]) for r in out["plans"]] == [
        (r["strategy"], r["activation_checkpointing"], r["micro_batch"]) for r in expect
    ]
    for argv, msg in (
        (["--strategy", "zero", "--plan", "80"], "strategy 'zero' unknown"),
        (["--dtype", "fp8", "--plan", "80"], "dtype 'fp8' unknown"),
        (["--size", "huge", "--plan", "80"], "--size huge"),
        (["--plan", "0"], "must be positive"),
        (["--micro-batch", "2", "--world-size", "3"], "torchrun --nproc_per_node 3"),
    ):
        assert cli.main(["bench", "memory", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and "\n" not in err


def test_a_modern_preset_is_planned_with_its_modern_block(capsys):
    """The run plan and `bench memory --preset` hand the preset's GPTConfig to the planner, whose
    activations and loss terms then follow its switches (checked against autograd above)."""
    from dataclasses import replace

    from gpt2lab.system import runtime
    from gpt2lab.train.gather import MachineFacts
    from gpt2lab.train.plan import make_plan

    cfg = load_preset("gpt2-124m-fast", data="unused", hellaswag_interval=0)
    assert cfg.model.modern()["pos_emb"] == "rotary" and cfg.model.logit_softcap > 0
    h100 = MachineFacts(
        runtime.Facts("cuda", "NVIDIA H100 80GB HBM3", cuda_bf16=True), world_size=8, device_bytes=80 * 2**30
    )
    plan = make_plan(cfg, h100)
    kw = dict(
        strategy=plan.strategy.value,
        world_size=8,
        micro_batch=cfg.batch.micro_batch_size,
        seq_len=cfg.batch.seq_len,
        dtype="bfloat16",
        accum=plan.accum,
        device="cuda",
        compiled=True,
        optimizer=cfg.optim.optimizer,
        muon_variant=cfg.optim.muon_variant,
    )
    assert cfg.optim.optimizer == "muon"
    assert plan.memory == memplan.predict(cfg.model, **kw).to_dict()
    gpt2 = replace(cfg.model, pos_emb="learned", norm="layernorm", qk_norm=False, mlp_act="gelu")
    modern, plain = memplan.predict(cfg.model, **kw).terms, memplan.predict(gpt2, **kw).terms
    B, T, L, C = cfg.batch.micro_batch_size, cfg.batch.seq_len, cfg.model.n_layer, cfg.model.n_embd
    blocks = L * (memplan.block_saved_bytes(cfg.model, B, T, 2) - memplan.block_saved_bytes(gpt2, B, T, 2))
    ln_f = B * T * (memplan.norm_saved_bytes("rmsnorm", C, "cuda") - memplan.norm_saved_bytes("layernorm", C, "cuda"))
    rope_tables = 2 * T * 64 * 4  # cos and sin, (T, head size 64) fp32
    assert blocks > 0 and modern["activations"] - plain["activations"] == blocks + ln_f + rope_tables

    # bench memory --preset: the same architecture, its seq_len; the softcap's loss workspace on CPU
    assert (
        cli.main(
            [
                "bench",
                "memory",
                "--preset",
                "wiki-cpu-fast",
                "--micro-batch",
                "2",
                "--dtype",
                "float32",
                "--device",
                "cpu",
                "--measure",
                "false",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    fast = load_preset("wiki-cpu-fast")
    assert out["seq_len"] == fast.batch.seq_len and out["modern"] == fast.model.modern()
    want = memplan.predict(fast.model, micro_batch=2, seq_len=fast.batch.seq_len, dtype="float32", device="cpu")
    assert out["predicted_mib"] == want.to_dict()
    capped = memplan.predict(
        replace(fast.model, logit_softcap=15.0),
        micro_batch=2,
        seq_len=fast.batch.seq_len,
        dtype="float32",
        device="cpu",
    )
    assert capped.terms["loss"] > want.terms["loss"]
    assert cli.main(["bench", "memory", "--preset", "wiki-cpu", "--size", "124M", "--measure", "false"]) == 2
    assert "--size and --preset" in capsys.readouterr().err


def test_presets_state_what_the_planner_chooses():
    for name in ("gpt2-350m", "gpt2-774m", "gpt2-1558m"):
        text = (resources.files("gpt2lab") / "presets" / f"{name}.toml").read_text()
        cfg = load_preset(name)
        model = cfg.model
        stated = re.findall(
            r"# assumes (\d+) x (\d+)GB: (ddp|fsdp)(, activation checkpointing)?, "
            r"micro_batch_size (\d+)",
            text,
        )
        assert {s[1] for s in stated} == {"80", "40"}, name
        for world, gb, strategy, ac, mb in stated:
            got = memplan.choose(
                int(gb) * 2**30,
                model,
                world_size=int(world),
                seq_len=cfg.batch.seq_len,
                total_batch_tokens=cfg.batch.total_batch_tokens,
            )
            assert got == {"strategy": strategy, "activation_checkpointing": bool(ac), "micro_batch": int(mb)}, name
            if gb == "80":  # the values the preset trains with; --strategy auto lands on the stated one
                assert (cfg.parallel.strategy, cfg.batch.micro_batch_size, cfg.parallel.activation_checkpointing) == (
                    "auto",
                    int(mb),
                    bool(ac),
                ), name
                ddp = memplan.predict(
                    model,
                    strategy="ddp",
                    world_size=int(world),
                    micro_batch=int(mb),
                    seq_len=cfg.batch.seq_len,
                    dtype="bfloat16",
                    activation_checkpointing=bool(ac),
                    accum=cfg.grad_accum_steps(int(world)),
                    device="cuda",
                    compiled=True,
                ).total
                auto = choose_strategy(
                    "auto",
                    world_size=int(world),
                    device_type="cuda",
                    dtype="bfloat16",
                    ddp_bytes=ddp,
                    device_bytes=int(gb) * 2**30,
                )
                assert auto.value == strategy, (name, auto.reason)


def test_cpu_step_measured_next_to_the_prediction(capsys):
    argv = [
        "bench",
        "memory",
        "--size",
        "tiny",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--dtype",
        "float32",
        "--steps",
        "2",
        "--tensor-peak",
        "true",
        "--device",
        "cpu",
    ]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    pred = out["predicted_mib"]
    terms = sum(v for k, v in pred.items() if k not in ("phase", "total"))
    assert abs(terms - pred["total"]) < 0.2  # rounded terms add up to the total
    assert out["measured_peak_mib"][0] > 0 and out["measured_rss_before_model_mib"][0] > 0
    # every tensor the step allocated, from the profiler: the planner's terms without the runtime
    assert out["tensors_over_predicted"] == pytest.approx(1.0, abs=0.02)


def test_the_loss_term_follows_the_trainers_loss_and_the_h100_peaks():
    """Compiled on a GPU the trainer keeps the (N, V) bf16 logits instead of the chunked loss's
    workspace; both predictions against the peaks of gpt2lab's step measured on an H100 (124M,
    B=64, T=1024, one micro-step: 23.92 GiB chunked, 28.48 GiB compiled cross-entropy;
    benchmarks/results/h100/ladder_b64_call2.jsonl and ladder_b64_loss_call3.jsonl). The
    chunked run compiled the loss's kernel, which keeps less per chunk than the eager kernel the
    planner replays: 24.21 GiB predicted, 1.2% over."""
    cfg = model_config("124M", 1024)
    kw = dict(micro_batch=64, seq_len=1024, dtype="bfloat16", accum=1, device="cuda")
    chunked, fused = memplan.predict(cfg, **kw), memplan.predict(cfg, compiled=True, **kw)
    assert fused.terms["loss"] == 64 * 1024 * 50304 * 2
    assert memplan.predict(cfg, strategy="fsdp", world_size=2, compiled=True, **kw).terms["loss"] < fused.terms["loss"]
    for pred, measured in ((chunked, 23.92), (fused, 28.48)):
        tensors = (pred.total - pred.terms["runtime"]) / 2**30
        assert tensors == pytest.approx(measured, rel=0.03)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize(
    "block",
    [{}, dict(pos_emb="rotary", norm="rmsnorm", qk_norm=True, mlp_act="relu2", tie_embeddings=False)],
    ids=["gpt2", "modern"],
)
def test_optimizer_state_bytes_equal_what_the_optimizer_keeps(optimizer, block):
    """The real optimizer of a run (train.optim.build_optimizer) after one step: its state's
    tensors (0-d step counters aside) against the planner's count."""
    from dataclasses import replace

    from gpt2lab.train.optim import build_optimizer, parts

    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=101, block_size=16, **block)
    model = GPT(cfg)
    opt = replace(load_preset("wiki-cpu-fast").optim, optimizer=optimizer)
    optim = build_optimizer(model, opt, torch.device("cpu"))
    idx = torch.randint(0, 101, (2, 16))
    model(idx, targets=idx)[1].backward()
    optim.step()
    kept = sum(
        t.numel() * t.element_size()
        for o in parts(optim)
        for state in o.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    assert kept == memplan.optimizer_state_bytes(cfg, optimizer)
    if optimizer == "muon":  # one buffer instead of two for the blocks' four matrices
        assert kept == memplan.optimizer_state_bytes(cfg, "adamw") - 4 * 2 * 12 * 32**2
