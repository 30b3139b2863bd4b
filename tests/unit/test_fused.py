"""inference/fused.py: the held model's fused decode step (``_gemv.model_step``) against the network's own
code on the same held weights, through both caches the model decodes with (KVCache, the server's
RowsCache), and the calls it must leave to the network's code."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import tiny_gpt

from gpt2lab.inference import kernels
from gpt2lab.inference.choice import Candidate
from gpt2lab.inference.form import hold as _hold
from gpt2lab.inference.fused import fusable
from gpt2lab.inference.kernels import gemv_error
from gpt2lab.serve.rows import RowsCache

WHY_NOT = gemv_error(torch.device("cpu"))
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


def hold(model, cand, **kw):
    """form.hold with a prompt's rows as the decode step computes them (fp32 products): these tests compare
    a token run inside a prompt with the same token decoded (a CPU with native bf16 would otherwise
    round a prompt's inputs to bf16: tests/unit/test_kernels.py)."""
    return _hold(model, cand, bf16_inputs=False, **kw)


CANDS = [Candidate("float32", "int8-gemv"), Candidate("bfloat16", "gemv")]
# How bf16 weights meet their inputs: unrounded; rounded to bf16, the weights row-major (a CPU whose
# compiled kernel has no AVX512_BF16 routines) or in panels (one that has them; elsewhere the panels'
# plain C loops, the same sums): both branches on any CPU.
INPUTS = ["fp32-inputs", "bf16-inputs-rows", "bf16-inputs-panels"]


def _hold_as(model, cand, inputs, monkeypatch, **kw):
    """form.hold of ``cand`` with its inputs as ``inputs`` (one of INPUTS) asks."""
    monkeypatch.setattr(kernels, "panels_run", lambda k: inputs == "bf16-inputs-panels" and k % 2 == 0)
    ready = _hold(model, cand, bf16_inputs=inputs != "fp32-inputs", **kw)
    panels = inputs == "bf16-inputs-panels" and cand.kernel == "gemv"
    assert not panels or any(getattr(m, "route", "") == "panels" for m in ready.modules())
    return ready


@pytest.fixture
def counted(monkeypatch):
    """The fused calls that did their work while the test runs: {"model_step": [...]} (model_step returns
    False, having done nothing, for an id or a position outside its table)."""
    from gpt2lab.inference import _gemv

    calls = {"model_step": []}

    def spy(fn, seen):
        def call(*a):
            done = fn(*a)
            if done is not False:
                seen.append(a)
            return done

        return call

    for name, seen in calls.items():
        monkeypatch.setattr(_gemv, name, spy(getattr(_gemv, name), seen))
    return calls


def _unfused(model):
    """The same held model with the network's own forward everywhere."""
    model.fused = False
    return model


@pytest.mark.parametrize(
    "cand, inputs",
    [(c, INPUTS[0]) for c in CANDS] + [(Candidate("bfloat16", "gemv"), i) for i in INPUTS[1:]],  # bf16 weights
    ids=str,
)
@pytest.mark.parametrize(
    "shape",
    [
        dict(n_head=2, n_embd=32),
        dict(n_head=3, n_embd=36, bias=False),
        dict(n_head=2, n_embd=144),
        dict(n_head=1, n_embd=128),
    ],
    ids=["32", "36", "144", "128"],
)
@pytest.mark.parametrize("rows", [1, 6])  # six: a tile of four rows, then one of two
def test_one_token_fused_equals_the_models_own_forward_with_the_same_cache(
    cand, shape, rows, inputs, counted, monkeypatch
):
    """Logits and the KV cache after several one-token steps, fused against unfused, from the same prompt
    (36 wide: heads of 12, not a multiple of 8; no biases; 144:
    heads of 72, wider than GPT-2's 64; 128: one head of 128, the values summed 64 dimensions at a time;
    10-30 keys, so the keys are scored eight at a time with some left over); bf16 weights also with their
    inputs rounded to bf16 (a hold on a CPU with native bf16: the fused step's products and the linears'
    own alike), the weights row-major or in panels. The whole step takes the head too, at any rows (its
    forward takes a bf16 head's several rows through PyTorch)."""
    model = tiny_gpt(seed=5, vocab_size=97, block_size=40, **shape)
    idx = torch.randint(0, 97, (rows, 30), generator=torch.Generator().manual_seed(3))
    outs, caches = [], []
    for fused in (True, False):
        ready = _hold_as(model, cand, inputs, monkeypatch)
        assert ready.fused
        ready.fused = fused
        cache = ready.new_kv_cache(40)
        with torch.inference_mode():
            ready(idx[:, :9], kv_cache=cache)
            outs.append(torch.cat([ready(idx[:, t : t + 1], kv_cache=cache)[0] for t in range(9, 30)], dim=1))
        caches.append(cache)
    assert len(counted["model_step"]) == 21
    assert all(a[20] != 0 and a[23] == 97 for a in counted["model_step"])  # the head's weight, its 97 outputs
    pairs = [(outs[0], outs[1])]
    pairs += [(a[:, :, :30], b[:, :, :30]) for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v)]
    # Rounding to bf16 is a step: the C LayerNorm and PyTorch's differ by ~1e-7, which moves an input
    # across a rounding boundary now and then (one bf16 step, 2^-8 of it, in one product), and the cache
    # carries that on; so rounded, the two agree to what such steps move (the products themselves: the
    # rounded kernels' exact tests in test_kernels.py; a row alone or in a batch: the test below).
    tol = 1e-5 if inputs == "fp32-inputs" else 2e-3
    for a, b in pairs:
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("inputs", INPUTS)
def test_a_decoded_row_is_the_same_alone_or_in_a_batch(inputs, counted, monkeypatch):
    """Each of five rows decoded in one fused step (a tile of four, then one row) against each row alone,
    from the same prompts: the same sums up to their order, with the inputs rounded to bf16 too (the
    server's batch gives a request the text it would get alone); in panels the very same sums, bit for
    bit (each output's sum runs over the inputs in one order whatever the rows)."""
    model = tiny_gpt(seed=7, vocab_size=97, block_size=40)
    ready = _hold_as(model, Candidate("bfloat16", "gemv"), inputs, monkeypatch, rows=5)
    idx = torch.randint(0, 97, (5, 12), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        batch_cache = ready.new_kv_cache(40)
        ready(idx[:, :11], kv_cache=batch_cache)
        both = ready(idx[:, 11:], kv_cache=batch_cache)[0]
        alone = []
        for r in range(5):
            cache = ready.new_kv_cache(40)
            ready(idx[r : r + 1, :11], kv_cache=cache)
            alone.append(ready(idx[r : r + 1, 11:], kv_cache=cache)[0])
    assert len(counted["model_step"]) == 6
    tol = 0 if inputs == "bf16-inputs-panels" else 1e-5
    torch.testing.assert_close(both, torch.cat(alone), rtol=tol, atol=tol)


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
            rows.put(slot, cache, 2, 0, n)
        assert counted == {"model_step": []}  # the prompts: the model's code
        both, _ = ready(torch.stack([idx[0, 7:8], idx[1, 10:11]]), kv_cache=rows.view(torch.device("cpu")))
        rows.remove(1)
        alone, _ = ready(idx[:1, 8:9], kv_cache=rows.view(torch.device("cpu")))
    assert len(counted["model_step"]) == 2
    torch.testing.assert_close(both[:, 0], torch.stack([whole[0, 7], whole[1, 10]]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(alone[0, 0], whole[0, 8], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cand", CANDS, ids=str)
def test_prompts_run_as_rows_of_the_step_beside_decoding_rows(cand, counted):
    """step_rows (the server's mixed step): a running row's next token (slot 0) and two prompts of 5 and 3
    tokens (slots 2 and 1, each token a row at its own position, the second's in reverse order: every key
    and value is written before any row attends) in one fused call. The logits asked for
    (the running row's and each prompt's last, in the order asked) and every later step from that cache
    equal each sequence run whole; a slot outside the buffers or a position past them is refused (None),
    the cache untouched."""
    model = tiny_gpt(seed=6, vocab_size=97, block_size=40)
    ready = hold(model, cand, rows=3)
    g = torch.Generator().manual_seed(8)
    seqs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (9, 3, 5)]
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    with torch.inference_mode():
        rows = RowsCache(model.config.n_layer, 40)
        cache = ready.new_kv_cache(40)
        ready(torch.tensor([seqs[0][:8]]), kv_cache=cache)
        rows.put(0, cache, 1, 0, 8)
        rows.reserve(3, 9, model.config.n_head, model.config.n_embd // model.config.n_head)
        before = [t.clone() for t in rows.k]
        ids = [seqs[0][8], *seqs[2], *reversed(seqs[1])]
        slots, positions = [0, 2, 2, 2, 2, 2, 1, 1, 1], [8, 0, 1, 2, 3, 4, 2, 1, 0]
        refused = (([0, 2, 2, 2, 2, 3, 1, 1, 1], positions), (slots, [8, 0, 1, 2, 3, 40, 2, 1, 0]))  # slot 3; 40
        for bad_slots, bad_positions in refused:
            assert ready.step_rows(i64(ids), i64(bad_slots), i64(bad_positions), i64([0, 5, 6]), rows) is None
        assert all(torch.equal(a, b) for a, b in zip(before, rows.k))
        got = ready.step_rows(i64(ids), i64(slots), i64(positions), i64([0, 6, 5]), rows)
        rows.lengths = [9, 3, 5]
        for seq, logits in zip(seqs, got):
            torch.testing.assert_close(logits, ready(torch.tensor([seq]))[0][0, -1], rtol=1e-4, atol=1e-4)
        for _ in range(3):  # the prompts' keys and values are where the next steps read them
            new = torch.randint(0, 97, (3, 1), generator=g)
            step, _ = ready(new, kv_cache=rows.view(torch.device("cpu")))
            for i, seq in enumerate(seqs):
                seq.append(int(new[i]))
                torch.testing.assert_close(step[i, 0], ready(torch.tensor([seq]))[0][0, -1], rtol=1e-4, atol=1e-4)
    assert len(counted["model_step"]) == 4  # the mixed step and three decode steps (the refused ones did nothing)


def test_prompt_rows_the_fused_step_takes_by_how_the_linears_meet_a_prompt(monkeypatch):
    """fused.prompt_rows, faked on any CPU: panels (the AVX512_BF16 routines, or their plain C loops) and
    int8-gemv run a prompt by the same kernel either way, so the fused step takes the whole context; a
    row-major bf16 hold (no AVX512_BF16 routines, or fp32 inputs) only up to its tile_rows, past which its
    forward's matmul was measured faster; a model without the fused step none."""
    from gpt2lab.inference.fused import prompt_rows
    from gpt2lab.inference.kernels import set_tile_rows

    model = tiny_gpt(seed=6, vocab_size=97, block_size=40)
    assert prompt_rows(model) == 0
    assert prompt_rows(_hold_as(model, Candidate("bfloat16", "gemv"), "bf16-inputs-panels", monkeypatch)) == 40
    assert prompt_rows(hold(model, Candidate("float32", "int8-gemv"))) == 40
    for inputs in ("fp32-inputs", "bf16-inputs-rows"):
        rows = _hold_as(model, Candidate("bfloat16", "gemv"), inputs, monkeypatch)
        set_tile_rows(rows, 6)
        assert prompt_rows(rows) == 6
        assert prompt_rows(_unfused(rows)) == 0


def test_what_it_leaves_to_the_model(counted):
    """The modern block is not fusable, nor a block of plain linears; the held model is a wrapper: the
    network it holds keeps its class, and runs its own code where the step is not fused."""
    from gpt2lab.inference.fused import HeldGPT

    assert not any(fusable(b) for b in hold(tiny_gpt(seed=1, norm="rmsnorm"), CANDS[0]).transformer.h)
    assert not any(fusable(b) for b in hold(tiny_gpt(seed=1), Candidate("float32", "plain")).transformer.h)
    model = tiny_gpt(seed=2, vocab_size=97)
    ready = hold(model, CANDS[0])
    assert isinstance(ready, HeldGPT) and type(ready.net) is type(model) and ready.config == model.config
    assert all(type(b) is type(model.transformer.h[0]) and fusable(b) for b in ready.transformer.h)
    assert ready.tokenizer is model.tokenizer and ready.new_kv_cache(7).max_len == 7


def test_what_the_whole_step_leaves_to_the_model(counted):
    """The whole step only where the model's structure and the call are what model_step computes; every
    other call runs GPT.forward (which says what is wrong with a bad one), with the same logits."""
    assert not hold(tiny_gpt(seed=1, logit_softcap=30.0), CANDS[0]).fused  # fusable blocks, not the whole step
    ready = hold(tiny_gpt(seed=2, vocab_size=97, block_size=16), CANDS[0])
    steps = counted["model_step"]
    cache = ready.new_kv_cache(16)
    tok = torch.tensor([[5]])
    with torch.no_grad():
        ready(torch.tensor([[1, 2, 3]]), kv_cache=cache)  # the prompt
        assert steps == []
        want, _ = ready(tok, kv_cache=cache)
        assert len(steps) == 1 and cache.pos == 4
        cache.pos = 3
        for call in (
            lambda: ready(tok, kv_cache=cache, targets=torch.tensor([[7]])),  # a loss wanted
            lambda: ready(tok, kv_cache=cache, positions=torch.tensor([0])),
            lambda: ready(tok.int(), kv_cache=cache),  # int32 ids: the embedding takes them, the kernel does not
        ):
            got, _ = call()
            cache.pos = 3
            torch.testing.assert_close(got.reshape(-1), want.reshape(-1), rtol=1e-5, atol=1e-5)
        ready.train()
        ready(tok, kv_cache=cache)
        ready.eval()
        cache.pos = 3
        with pytest.raises(IndexError):  # an id outside the vocabulary: the embedding's own error
            ready(torch.tensor([[97]]), kv_cache=cache)
        cache.pos = 16
        with pytest.raises(ValueError, match="block_size"):  # past the model's positions
            ready(tok, kv_cache=cache)
        cache.pos = 3
        ready.transformer.ln_f.double()  # the final norm cast after holding: the model's code
        with contextlib.suppress(RuntimeError):
            ready(tok, kv_cache=cache)
    assert len(steps) == 1
    cache.pos = 3
    ready.transformer.ln_f.float()
    with torch.enable_grad():  # an embedding that wants gradients, with grad on: the model's code for autograd
        ready.transformer.wte.weight.requires_grad_(True)
        got, _ = ready(tok, kv_cache=cache)
    assert len(steps) == 1
    torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cand", CANDS, ids=str)
def test_gelu_and_softmax_far_from_zero(cand, counted):
    """The kernel's own exp (GELU, softmax) over wide inputs: fc pre-activations of tens (GELU's tails, where
    it is 0 or the input) and attention scores spread over tens, fused against unfused."""
    model = tiny_gpt(seed=8, vocab_size=97, block_size=40)
    with torch.no_grad():
        for b in model.transformer.h:
            b.mlp.c_fc.weight.mul_(40.0)
            b.attn.c_attn.weight[: model.config.n_embd].mul_(30.0)  # the queries: scores of tens
    idx = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(9))
    outs = []
    for ready in (hold(model, cand), _unfused(hold(model, cand))):
        cache = ready.new_kv_cache(40)
        with torch.inference_mode():
            ready(idx[:, :9], kv_cache=cache)
            outs.append(torch.cat([ready(idx[:, t : t + 1], kv_cache=cache)[0] for t in range(9, 30)], dim=1))
    assert len(counted["model_step"]) == 21
    scale = outs[1].abs().max()
    torch.testing.assert_close(outs[0] / scale, outs[1] / scale, rtol=0, atol=2e-6)


def test_a_cast_and_back_reads_the_new_tensors(counted):
    """After the held model is cast and cast back (its embeddings and norms now in new storage) the whole step
    reads the new tensors: the same logits as before, and as the model's own code."""
    ready = hold(tiny_gpt(seed=3, vocab_size=97, block_size=16), CANDS[0])
    prompt, tok = torch.tensor([[4, 8, 15]]), torch.tensor([[16]])
    got = []
    for cast in (False, True, False):
        if cast:
            ready.double().float()
        model = ready if len(got) < 2 else _unfused(ready)
        cache = model.new_kv_cache(16)
        with torch.inference_mode():
            model(prompt, kv_cache=cache)
            got.append(model(tok, kv_cache=cache)[0])
    assert len(counted["model_step"]) == 2
    torch.testing.assert_close(got[1], got[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], got[2], rtol=1e-5, atol=1e-5)


def test_the_whole_step_refuses_a_model_without_a_head_or_a_kind_it_does_not_know():
    """model_step computes the logits: a head weight of 0, or a kind other than 0-3 (int8, bf16, bf16 with
    its inputs rounded, that in panels), is refused before anything is read."""
    from gpt2lab.inference import _gemv

    # kind, rows, width, heads, layers, ids, wte, wpe, vocab, n_pos, layers' table, max_len, positions, pos0,
    # out, eps, ln_f g, b, eps, head kind, head weight (none), scale, bias, n_out, threads, slots, n_slots,
    # wanted, n_wanted
    args = [1, 1, 8, 2, 1, 0, 0, 0, 10, 10, 0, 4, 0, 1, 0, 1e-5, 0, 0, 1e-5, 1, 0, 0, 0, 10, 1, 0, 1, 0, 0]
    with pytest.raises(ValueError, match="model_step: bad .* head"):
        _gemv.model_step(*args)
    for at in (0, 19):  # the blocks' kind, the head's
        with pytest.raises(ValueError, match="model_step: bad kinds"):
            _gemv.model_step(*args[:at], 4, *args[at + 1 : 20], 1, *args[21:])
