"""The memory planner (gpt2lab.train.memplan) and `gpt2lab bench memory`: the fake step against the
profiler's record of real steps (every lever, the chunked loss, the optimizers) and against torch's
MemTracker on the same fake step, the sizes against the real model and optimizer, the strategies'
arithmetic, the H100's measured peaks, the plan."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from importlib import resources

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from gpt2lab import cli
from gpt2lab.benchmarks.memory import _tensor_peak
from gpt2lab.distributed import parallel
from gpt2lab.model import loss as chunked
from gpt2lab.model.gpt import GPTConfig
from gpt2lab.model.loss import LossPath
from gpt2lab.train import memplan
from gpt2lab.train.optim import parts
from gpt2lab.train.settings import load_preset

N_124M = 124_475_904  # GPT-2 124M with the vocab padded to 50304 (nanoGPT's printed count)
CPU = torch.device("cpu")
SMALL = dict(n_layer=2, n_head=2, n_embd=64, block_size=64, seq_len=64, micro_batch_size=4, total_batch_tokens=512)
MODERN = dict(pos_emb="rotary", norm="rmsnorm", qk_norm=True, mlp_act="relu2", tie_embeddings=False)
LEVERS = dict(value_embeds=1, unet_skips=True, zero_init_head=True, mtp_heads=2, embed_norm=True, bias=False)


def _cfg(**fields):
    return load_preset("gpt2-124m", **{**SMALL, **fields})


def _measured_peak(cfg, dtype: str, accum: int) -> int:
    """The profiler's peak of live tensor bytes over two real steps as the fake run takes them (the
    state made, then a step: ``accum`` micro-steps, clipping, the optimizer), the weights and state
    made before it included."""
    torch.manual_seed(0)
    model, optimizer = memplan._build(cfg, CPU)
    model.set_loss(LossPath(chunked=True))
    model.activation_checkpointing = cfg.parallel.activation_checkpointing
    before = sum(p.untyped_storage().nbytes() for p in model.parameters())
    before += sum(t.untyped_storage().nbytes() for o in parts(optimizer) for s in o.state.values() for t in s.values())
    b = cfg.batch
    x = torch.randint(0, cfg.model.real_vocab_size, (b.micro_batch_size, b.seq_len))

    def step():
        parallel.accumulate_gradients(model, lambda: (x, x), accum, CPU, dtype)
        parallel.clip_grad_norm(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _tensor_peak(step) + before


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
@pytest.mark.parametrize(
    "fields,dtype,accum",
    [
        ({}, "float32", 2),
        ({}, "bfloat16", 1),
        ({"activation_checkpointing": True}, "float32", 2),
        ({**MODERN, "optimizer": "muon", "muon_variant": "normuon"}, "float32", 2),
        ({**MODERN, **LEVERS}, "bfloat16", 2),
        ({**MODERN, "logit_softcap": 15.0}, "float32", 1),
    ],
    ids=["gpt2-fp32", "gpt2-bf16", "checkpointing", "modern-normuon", "levers-bf16", "softcap"],
)
def test_the_fake_step_is_the_peak_of_the_real_one(fields, dtype, accum):
    """The planner runs the step on fake tensors; the same step on real ones, every allocation recorded
    by the profiler, peaks at the same bytes (the forward's peak: these shapes hold more activations
    than a backward's transient gradients). oneDNN is off for the count: on CPUs with native bf16 its
    bf16 matmuls take scratch memory of their own, which differs by CPU."""
    cfg = _cfg(**fields)
    with torch.backends.mkldnn.flags(enabled=False):
        real = _measured_peak(cfg, dtype, accum)
    predicted = memplan.predict(cfg, dtype=dtype, accum=accum, device="cpu")
    fake = predicted.total - predicted.terms["runtime"] - predicted.terms["allocator"]
    assert fake == pytest.approx(real, rel=0.005), (fake / 2**20, real / 2**20)


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
@pytest.mark.parametrize("softcap", [0.0, 15.0], ids=["nocap", "softcap"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("N,V,C", [(1000, 500, 16), (100, 2000, 8), (17, 1000, 64), (40, 300, 200)])
def test_the_loss_workspace_is_the_peak_of_the_chunked_loss(monkeypatch, N, V, C, dtype, softcap):
    """The chunked loss's own peak on fake tensors (the CPU heap's slack term, and what a compiled
    graph's logits replace) against the profiler's record of the real loss. Chunks shrunk so that the
    shapes have several chunks per group and several groups, a peak inside the kernel, a partial last
    chunk, one group, and a peak at the grad_w matmul."""
    monkeypatch.setattr(chunked, "_CHUNK_ELEMENTS", 2**14)
    monkeypatch.setattr(chunked, "_GROUP_ELEMENTS", 2**15)
    monkeypatch.setattr(memplan, "_CACHE", {})  # measured with these chunks, not read from the cache
    model = GPTConfig(vocab_size=V, n_embd=C, n_head=1, logit_softcap=softcap)
    torch.manual_seed(0)
    x, w = torch.randn(N, C, requires_grad=True), torch.randn(V, C, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    with torch.backends.mkldnn.flags(enabled=False), torch.autocast("cpu", torch.bfloat16, enabled=dtype != "float32"):
        real = _tensor_peak(lambda: chunked.chunked_cross_entropy(x, w, targets, softcap=softcap))
    assert abs(memplan._loss_bytes(model, N, dtype) - real) <= 64  # a few 0-d scalars apart


def test_sizes_are_the_models_and_its_optimizers():
    """Parameters, weights and optimizer state counted on the meta device against the known 124M figure
    and against the real optimizers' state after a step (0-d step counters aside)."""
    assert memplan.params(load_preset("gpt2-124m")) == N_124M
    weights, state = memplan.sizes(load_preset("gpt2-124m"))
    assert weights == 4 * N_124M and 0 <= state - 8 * N_124M < 1024  # two fp32 moments (and 0-d step counts)
    for fields in ({}, {**MODERN, "optimizer": "muon", "muon_variant": "normuon"}, {"lora_rank": 4}):
        cfg = _cfg(**fields)
        model, optimizer = memplan._build(cfg, CPU)  # real tensors, a real first step
        kept = sum(t.nbytes for o in parts(optimizer) for s in o.state.values() for t in s.values() if t.dim() > 0)
        weights, state = memplan.sizes(cfg)
        assert weights == sum(p.nbytes for p in model.parameters()) and 0 <= state - kept < 1024, fields
    lora, full = (memplan.sizes(_cfg(**f))[1] for f in ({"lora_rank": 4}, {}))
    assert lora < full / 100  # the adapters' state only


def test_the_strategies_share_out_what_one_process_holds():
    cfg = load_preset("gpt2-124m", micro_batch_size=1)
    one = memplan.predict(cfg, world_size=1)
    ddp = memplan.predict(cfg, strategy="ddp", world_size=2)
    assert ddp.terms["comm_buffers"] == 4 * N_124M and "comm_buffers" not in one.terms  # DDP's buckets
    assert ddp.total - one.total == 4 * N_124M and one.terms["runtime"] == memplan.CUDA_RUNTIME_BYTES
    fsdp = memplan.predict(cfg, strategy="fsdp", world_size=2)
    assert (fsdp.terms["weights"], fsdp.terms["optimizer"]) == (one.terms["weights"] // 2, one.terms["optimizer"] // 2)
    assert fsdp.total < one.total
    once = memplan.predict(cfg, strategy="fsdp", world_size=2, accum=1)  # two blocks gathered at a time
    assert fsdp.terms["step_tensors"] > once.terms["step_tensors"]  # accumulating: all of them, and the gradients
    avg = memplan.predict(cfg.with_values(ema_decay=0.9), world_size=1)
    assert avg.total - one.total == avg.terms["average"] == 4 * N_124M


def test_the_loss_term_follows_the_trainers_loss_and_the_h100_peaks():
    """Compiled on a GPU the trainer keeps the (N, V) bf16 logits instead of the chunked loss's
    workspace; both predictions against the peaks of gpt2lab's step measured on an H100 (124M,
    B=64, T=1024, one micro-step: 23.92 GiB chunked, 28.48 GiB compiled cross-entropy;
    benchmarks/results/h100/ladder_b64_call2.jsonl and ladder_b64_loss_call3.jsonl). The
    chunked run compiled the loss's kernel, which keeps less per chunk than the eager kernel the
    fake step runs: 24.21 GiB predicted, 1.2% over."""
    cfg = load_preset("gpt2-124m", micro_batch_size=64)
    kw = dict(dtype="bfloat16", accum=1, device="cuda")
    eager, fused = memplan.predict(cfg, **kw), memplan.predict(cfg, compiled=True, **kw)
    assert fused.total - eager.total == 64 * 1024 * 50304 * 2 - memplan._loss_bytes(cfg.model, 64 * 1024, "bfloat16")
    for pred, measured in ((eager, 23.92), (fused, 28.48)):
        assert (pred.total - pred.terms["runtime"]) / 2**30 == pytest.approx(measured, rel=0.03)


def test_cuda_keeps_what_its_own_kernels_keep():
    """The two kernels a CPU does not run: CUDA's fused RMSNorm (4 bytes a channel less per norm than the
    CPU's decomposition) and ReLU^2's pow in fp32 under CUDA's autocast (16 bytes a channel more)."""
    B, T, L, C = 4, 64, 2, 64
    for fields, per_token in (({"norm": "rmsnorm"}, -4 * C * (2 * L + 1)), ({"mlp_act": "relu2"}, 16 * C * L)):
        cfg = _cfg(**fields)
        cpu, cuda = (memplan.predict(cfg, dtype="bfloat16", device=d) for d in ("cpu", "cuda"))
        assert cuda.terms["step_tensors"] - cpu.terms["step_tensors"] == B * T * per_token


def test_plan_is_the_largest_micro_batch_that_fits():
    cfg = _cfg()
    budget = int(2.5 * 2**30)
    rows = {(r["strategy"], r["activation_checkpointing"]): r for r in memplan.largest_micro_batches(budget, cfg)}
    for (strategy, ac), r in rows.items():
        B = r["micro_batch"]

        def total(b):
            c = replace(
                cfg,
                batch=replace(cfg.batch, micro_batch_size=b),
                parallel=replace(cfg.parallel, activation_checkpointing=ac),
            )
            return memplan.predict(c, strategy=strategy, compiled=True).total  # the plan's defaults

        assert B >= 1 and total(B) <= budget < total(B + 1) and r["predicted_bytes"] == total(B)
    assert rows[("ddp", True)]["micro_batch"] > rows[("ddp", False)]["micro_batch"]
    assert all(r["micro_batch"] == 0 for r in memplan.largest_micro_batches(2**30, cfg))  # nothing fits 1 GiB


def test_bench_plan_and_bad_values(capsys):
    argv = ["bench", "memory", "--size", "tiny", "--seq-len", "64", "--plan", "2.5"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    expect = memplan.largest_micro_batches(int(2.5 * 2**30), _cfg(micro_batch_size=1, total_batch_tokens=64))
    assert [(r["strategy"], r["activation_checkpointing"], r["micro_batch"]) for r in out["plans"]] == [
        (r["strategy"], r["activation_checkpointing"], r["micro_batch"]) for r in expect
    ]
    for args, msg in (
        (["--strategy", "zero", "--plan", "80"], "strategy 'zero' unknown"),
        (["--dtype", "fp8", "--plan", "80"], "dtype 'fp8' unknown"),
        (["--size", "huge", "--plan", "80"], "--size huge"),
        (["--plan", "0"], "must be positive"),
        (["--micro-batch", "2", "--world-size", "3"], "torchrun --nproc_per_node 3"),
        (["--preset", "wiki-cpu", "--size", "124M", "--measure", "false"], "--size and --preset"),
    ):
        assert cli.main(["bench", "memory", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and "\n" not in err


def test_a_run_is_planned_as_it_trains(capsys):
    """The run plan and `bench memory --preset` predict the preset's run: its modern block, Muon, its
    seq_len; the softcap's larger loss workspace shows in the CPU heap's term."""
    from gpt2lab.system import runtime
    from gpt2lab.train.gather import MachineFacts
    from gpt2lab.train.plan import make_plan

    cfg = load_preset(
        "gpt2-124m-fast", data="unused", hellaswag_interval=0, micro_batch_size=2, total_batch_tokens=16384
    )
    h100 = MachineFacts(
        runtime.Facts("cuda", "NVIDIA H100 80GB HBM3", cuda_bf16=True), world_size=8, device_bytes=80 * 2**30
    )
    plan = make_plan(cfg, h100)
    want = memplan.predict(
        plan.config, strategy=plan.strategy.value, world_size=8, accum=plan.accum, device="cuda", compiled=True
    )
    assert cfg.optim.optimizer == "muon" and plan.memory == want.to_dict()
    argv = ["bench", "memory", "--preset", "wiki-cpu-fast", "--micro-batch", "2", "--dtype", "float32"]
    assert cli.main([*argv, "--device", "cpu", "--measure", "false"]) == 0
    out = json.loads(capsys.readouterr().out)
    fast = load_preset("wiki-cpu-fast")
    assert out["seq_len"] == fast.batch.seq_len and out["modern"] == fast.model.modern() and out["optimizer"] == "muon"
    run = fast.with_values(micro_batch_size=2, total_batch_tokens=4 * fast.batch.seq_len)
    assert out["predicted_mib"] == memplan.predict(run, dtype="float32", device="cpu").to_dict()
    capped = memplan.predict(run.with_values(model={"logit_softcap": 15.0}), dtype="float32", device="cpu")
    assert capped.terms["allocator"] > memplan.predict(run, dtype="float32", device="cpu").terms["allocator"]


def card_plan(gpu_bytes: int, cfg, *, world_size: int, dtype: str = "bfloat16") -> dict:
    """What a size preset assumes for a card: {"strategy", "activation_checkpointing", "micro_batch"}.

    The micro-batch is a power of two (so it divides a power-of-two batch at any power-of-two
    world size) no larger than the plan's nor than one step's share per rank. The strategy
    is the one with the larger such micro-batch, DDP on a tie (it moves no weights between
    ranks); activation checkpointing only where neither fits a sequence without it.
    """
    b = cfg.batch
    cap = max(1, b.total_batch_tokens // (b.seq_len * world_size))
    rows = []
    for strategy, ac in [(s, ac) for s in ("ddp", "fsdp") for ac in (False, True)]:

        def fits(B: int) -> bool:  # the planner's rule (parallel.fits) at the plan's defaults
            c = replace(
                cfg, batch=replace(b, micro_batch_size=B), parallel=replace(cfg.parallel, activation_checkpointing=ac)
            )
            total = memplan.predict(c, strategy=strategy, world_size=world_size, dtype=dtype, compiled=True).total
            return parallel.fits(total, gpu_bytes)

        B = 1 if fits(1) else 0
        while B and 2 * B <= cap and fits(2 * B):
            B *= 2
        rows.append({"strategy": strategy, "activation_checkpointing": ac, "micro_batch": B})
    return max(
        rows,
        key=lambda r: (
            not r["activation_checkpointing"] and r["micro_batch"] > 0,
            r["micro_batch"],
            r["strategy"] == "ddp",
        ),
    )


@pytest.mark.slow
def test_presets_state_what_the_planner_chooses():
    for name in ("gpt2-350m", "gpt2-774m", "gpt2-1558m"):
        text = (resources.files("gpt2lab") / "presets" / f"{name}.toml").read_text()
        cfg = load_preset(name)
        stated = re.findall(
            r"# assumes (\d+) x (\d+)GB: (ddp|fsdp)(, activation checkpointing)?, micro_batch_size (\d+)", text
        )
        assert {s[1] for s in stated} == {"80", "40"}, name
        for world, gb, strategy, ac, mb in stated:
            got = card_plan(int(gb) * 2**30, cfg, world_size=int(world))
            assert got == {"strategy": strategy, "activation_checkpointing": bool(ac), "micro_batch": int(mb)}, name
            if gb == "80":  # the values the preset trains with; --strategy auto lands on the stated one
                assert (cfg.parallel.strategy, cfg.batch.micro_batch_size, cfg.parallel.activation_checkpointing) == (
                    "auto",
                    int(mb),
                    bool(ac),
                ), name
                ddp = memplan.predict(cfg, world_size=int(world), accum=cfg.grad_accum_steps(int(world)), compiled=True)
                auto = parallel.choose_strategy(
                    "auto",
                    world_size=int(world),
                    device_type="cuda",
                    dtype="bfloat16",
                    ddp_bytes=ddp.total,
                    device_bytes=int(gb) * 2**30,
                )
                assert auto.value == strategy, (name, auto.reason)


def test_cpu_step_measured_next_to_the_prediction(capsys):
    argv = ["bench", "memory", "--size", "tiny", "--seq-len", "64", "--micro-batch", "4", "--dtype", "float32"]
    assert cli.main([*argv, "--steps", "2", "--tensor-peak", "true", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    pred = out["predicted_mib"]
    terms = sum(v for k, v in pred.items() if k not in ("phase", "total"))
    assert abs(terms - pred["total"]) < 0.2  # rounded terms add up to the total
    assert out["measured_peak_mib"][0] > 0 and out["measured_rss_before_model_mib"][0] > 0
    # every tensor the trainer's steps allocated, from the profiler: the planner's terms without the runtime
    assert out["tensors_over_predicted"] == pytest.approx(1.0, abs=0.02)


class _Scalars(TorchDispatchMode):
    """A fake tensor has no value: a read of one answers as on real data (the chunked loss's ``any`` false,
    the rest 1), which MemTracker alone cannot do (DataDependentOutputException)."""

    def __init__(self) -> None:
        super().__init__()
        self.anys: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return int(id(args[0]) not in self.anys)
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            (self.anys.add if func is torch.ops.aten.any.default else self.anys.discard)(id(out))
        return out


@pytest.mark.parametrize(
    "fields,dtype", [({}, "float32"), ({**MODERN, **LEVERS}, "bfloat16")], ids=["gpt2-fp32", "levers-bf16"]
)
def test_the_fake_step_peaks_where_torchs_mem_tracker_does(fields, dtype):
    """torch's own accounting, MemTracker, over the fake step built as the planner builds it (the model and
    optimizer with its state made, the first micro-step's gradients zero-filled, the last micro-step,
    clipping, the optimizer step) peaks at the planner's bytes exactly: on CPU neither rounds a storage
    up. (Two micro-steps run for real hold 4 bytes more: the first one's 0-d loss, alive through the
    second forward.)"""
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker", reason="torch without MemTracker")
    cfg = _cfg(**fields)
    got = memplan.fake_step(cfg, dtype, accum=2)
    with FakeTensorMode():
        with _Scalars():
            model, optimizer = memplan._build(cfg, CPU, lora=False)
        model.set_loss(LossPath(chunked=True))
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        x = torch.zeros((cfg.batch.micro_batch_size, cfg.batch.seq_len), dtype=torch.long)
        tracker = mem_tracker.MemTracker()
        tracker.track_external(model, optimizer, x)
        with tracker, _Scalars():
            parallel.accumulate_gradients(model, lambda: (x, x), 1, CPU, dtype)
            parallel.clip_grad_norm(model, cfg.optim.grad_clip)
            optimizer.step()
        peak = tracker.get_tracker_snapshot("peak")[CPU]["Total"]
    assert max(got.micro, got.step) == peak
