"""inference/pages.py: the held weights copied onto one mapping advised to use huge pages; the same bytes,
so the same logits, and each branch where nothing moves (no THP, "never", the advice refused, nothing the
hold made itself)."""

from __future__ import annotations

import mmap

import pytest
import torch
from conftest import tiny_gpt

from gpt2lab.inference import pages
from gpt2lab.inference.choice import Candidate
from gpt2lab.inference.form import hold
from gpt2lab.inference.kernels import gemv_error

MiB = 2**20
# held in bf16 ~4 MB, in int8 ~2.3 MB: more than one huge page (2 MiB) either way
BIG = dict(n_embd=256, n_head=4, vocab_size=3000)
HERE = pages.page_facts()
NO_THP = pages.PageFacts(None, None)
CANDS = [Candidate("bfloat16", "upcast"), Candidate("float32", "int8")]
if gemv_error(torch.device("cpu")) is None:
    CANDS += [Candidate("bfloat16", "gemv"), Candidate("float32", "int8-gemv")]


def _held(model):
    """(module, attribute, tensor) of every decode linear's own matmul weight."""
    return [
        (m, n, m.__dict__[n])
        for m in model.modules()
        for n in pages.ATTRIBUTES
        if pages._made(m.__dict__.get(n), set())
    ]


def _logits(model, idx):
    with torch.inference_mode():
        cache = model.new_kv_cache(idx.size(1) + 4)
        first = model(idx, kv_cache=cache)[0]
        step = model(idx[:, -1:], kv_cache=cache)[0]  # one decode step (the fused one where held so)
    return first, step


@pytest.mark.skipif(HERE.why_not() is not None, reason=f"this machine: {HERE.why_not()}")
@pytest.mark.parametrize("cand", CANDS, ids=lambda c: c.name)
def test_placed_weights_share_one_aligned_mapping_and_give_the_same_logits(cand, monkeypatch):
    model = tiny_gpt(**BIG)
    own = {n: p.data_ptr() for n, p in model.named_parameters()}
    placed = hold(model, cand)
    monkeypatch.setattr(pages, "page_facts", lambda: NO_THP)
    plain = hold(model, cand)
    assert plain.held_pages.why_not.startswith("no transparent huge pages")

    held = _held(placed)
    assert held and placed.held_pages.why_not is None
    # the mapping's bytes, hand-counted: each weight rounded up to 64 bytes, one after the other
    assert placed.held_pages.moved == sum(-(-t.nbytes // 64) * 64 for _, _, t in held)
    starts = sorted(t.data_ptr() for _, _, t in held)
    assert starts[0] % HERE.size == 0  # the first weight on a huge page's boundary
    assert starts[-1] - starts[0] < placed.held_pages.moved  # all in one mapping, in order
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for _, _, t in held)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # none overlaps another
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == own  # the source model's stay put
    for (_, _, a), (_, _, b) in zip(held, _held(plain)):
        assert a.dtype == b.dtype and torch.equal(a, b)

    idx = torch.randint(0, 3000, (2, 9))
    for got, want in zip(_logits(placed, idx), _logits(plain, idx)):
        assert torch.equal(got, want)


@pytest.mark.skipif(HERE.why_not() is not None, reason=f"this machine: {HERE.why_not()}")
def test_huge_bytes_of_a_placed_mapping_are_what_smaps_says():
    # weights of 6 MiB: the mapping's huge pages, if the kernel gave any, are whole pages within it
    model = tiny_gpt(n_embd=512, vocab_size=3000, n_layer=1, n_head=4)
    placed = hold(model, Candidate("bfloat16", "upcast"))
    p = placed.held_pages
    assert p.huge is not None and p.huge % HERE.size == 0
    assert p.huge <= -(-p.moved // HERE.size) * HERE.size
    first = min(t.data_ptr() for _, _, t in _held(placed))
    assert pages.huge_bytes(first) == p.huge


def test_huge_bytes_reads_the_mapping_that_holds_the_address(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "7f0000000000-7f0000400000 rw-p 00000000 00:00 0 \n"
        "Size:               4096 kB\n"
        "AnonHugePages:      2048 kB\n"
        "7f0000400000-7f0000401000 r--p 00000000 08:01 1234    /usr/lib/libc.so.6\n"
        "Size:                  4 kB\n"
        "AnonHugePages:         0 kB\n"
        "VmFlags: rd mr mw me\n"
    )
    assert pages.huge_bytes(0x7F0000000000 + 123, str(smaps)) == 2 * MiB
    assert pages.huge_bytes(0x7F0000400000, str(smaps)) == 0
    assert pages.huge_bytes(0x7E0000000000, str(smaps)) is None
    assert pages.huge_bytes(0x7F0000000000, str(tmp_path / "absent")) is None


def test_page_facts_reads_the_size_and_the_bracketed_mode(tmp_path):
    (tmp_path / "hpage_pmd_size").write_text("2097152\n")
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    assert pages.page_facts(str(tmp_path)) == pages.PageFacts(2 * MiB, "madvise")
    (tmp_path / "enabled").write_text("always madvise [never]\n")
    facts = pages.page_facts(str(tmp_path))
    assert facts.mode == "never" and "never" in facts.why_not()
    assert pages.page_facts(str(tmp_path / "absent")) == pages.PageFacts(None, None)


@pytest.mark.parametrize(
    "facts, says",
    [(NO_THP, "no transparent huge pages"), (pages.PageFacts(2 * MiB, "never"), "set to never")],
)
def test_no_huge_pages_leaves_every_weight_where_it_is(facts, says, monkeypatch):
    monkeypatch.setattr(pages, "page_facts", lambda: facts)
    held = hold(tiny_gpt(), Candidate("bfloat16", "upcast"))
    before = [t.data_ptr() for _, _, t in _held(held)]
    p = pages.place(held, facts=facts)
    assert p.moved == 0 and says in p.why_not and p.describe().startswith("4 KiB pages")
    assert [t.data_ptr() for _, _, t in _held(held)] == before


def test_a_refused_advice_leaves_the_weights_and_says_so(monkeypatch):
    monkeypatch.setattr(pages, "page_facts", lambda: NO_THP)
    held = hold(tiny_gpt(**BIG), Candidate("bfloat16", "upcast"))
    before = [t.data_ptr() for _, _, t in _held(held)]

    class Refusing:
        def __init__(self, *a, **k):
            pass

        def madvise(self, *a):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(mmap, "mmap", Refusing)
    p = pages.place(held, facts=pages.PageFacts(2 * MiB, "madvise"))
    assert p.moved == 0 and "refused" in p.why_not and "Invalid argument" in p.why_not
    assert [t.data_ptr() for _, _, t in _held(held)] == before


def test_weights_shared_with_the_source_model_are_not_copied():
    model = tiny_gpt()
    held = hold(model, Candidate("float32", "plain"))  # fp32 as stored: the source model's own tensors
    assert held.held_pages.why_not == "no weights of its own to place" or HERE.why_not() is not None
    mine = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert all(t.untyped_storage().data_ptr() in mine for _, _, t in _held(held))


@pytest.mark.skipif(HERE.why_not() is not None, reason=f"this machine: {HERE.why_not()}")
def test_a_weight_two_modules_hold_is_placed_once_for_both():
    held = hold(tiny_gpt(**BIG), Candidate("bfloat16", "upcast"), rows=1)
    a, b = held.transformer.h[0].mlp.c_fc, held.transformer.h[1].mlp.c_fc
    b.weight = a.weight  # the same tensor in two modules
    want = a.weight.clone()
    p = pages.place(held)
    assert a.weight.data_ptr() == b.weight.data_ptr() and torch.equal(a.weight, want)
    assert p.moved == sum(-(-t.nbytes // 64) * 64 for t in {id(t): t for _, _, t in _held(held)}.values())


def test_weights_smaller_than_one_huge_page_stay():
    held = hold(tiny_gpt(), Candidate("bfloat16", "upcast"))  # ~30 KB of weights
    before = [t.data_ptr() for _, _, t in _held(held)]
    p = pages.place(held, facts=pages.PageFacts(2 * MiB, "madvise"))
    total = sum(-(-t.nbytes // 64) * 64 for _, _, t in _held(held))
    assert p.moved == 0 and p.why_not == f"held weights ({total} bytes) smaller than one huge page"
    assert [t.data_ptr() for _, _, t in _held(held)] == before
