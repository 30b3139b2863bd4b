"""inference/kernels.py, choice.py, probe.py and form.py: each decode linear against F.linear on the same
(rounded or dequantized) weights, a prepared model against the model it came from, and the choice
of precision and kernel in every branch with faked facts."""

from __future__ import annotations

import dataclasses
import json
import re
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import tiny_gpt

from gpt2lab.commands.env import entry_lines
from gpt2lab.inference import kernels
from gpt2lab.inference import probe as prep
from gpt2lab.inference.choice import Candidate, InferenceRequest, Timing, candidates, choose
from gpt2lab.inference.form import cache_key, cached_timings, for_inference, hold
from gpt2lab.inference.kernels import (
    DecodeLinear,
    _compiled_gemv,
    cannot_run,
    gemv_error,
    quantize_int8,
    swap_linears,
)
from gpt2lab.system import formats, runtime
from gpt2lab.system.runtime import ChoiceError, Facts

needs_onednn = pytest.mark.skipif(
    cannot_run("packed") is not None, reason="this torch build has no oneDNN packed linear"
)
needs_int8 = pytest.mark.skipif(cannot_run("int8") is not None, reason="no int8 weight-only kernel")
MODERN = dict(pos_emb="rotary", norm="rmsnorm", qk_norm=True, mlp_act="relu2", tie_embeddings=False, logit_softcap=15.0)


def _layer_inputs(bias: bool, shape=(5, 24)):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g) if bias else None
    return w, b, torch.randn(*shape, generator=g)


@pytest.mark.parametrize("shape", [(1, 24), (5, 24), (3, 7, 24)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kernel", ["plain", "decode", "packed"])
def test_fp32_decode_linears_equal_f_linear(kernel, bias, shape):
    if kernel == "packed" and cannot_run("packed"):
        pytest.skip("this torch build has no oneDNN packed linear")
    w, b, x = _layer_inputs(bias, shape)
    layer = DecodeLinear(w, b, kernel, torch.float32, batch_hint=8)
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (*shape[:-1], 40) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    if kernel == "decode":
        assert layer.weight.stride() == (1, 40)  # held column-major, the values unchanged


@pytest.mark.parametrize("kernel", ["plain", "packed"])
def test_bf16_decode_linears_multiply_bf16_inputs_by_bf16_weights(kernel):
    if kernel == "packed" and cannot_run("packed"):
        pytest.skip("this torch build has no oneDNN packed linear")
    if kernel == "packed" and cannot_run("packed", torch.bfloat16):
        pytest.skip(
            f"oneDNN cannot pack bf16 weights on this CPU ({cannot_run('packed', torch.bfloat16)}); "
            "test_bf16_packing_fact_is_what_onednn_does checks the refusal here"
        )
    w, b, x = _layer_inputs(True)
    layer = DecodeLinear(w, b, kernel, torch.bfloat16, batch_hint=4)
    with torch.inference_mode():
        got = layer(x)  # an fp32 input is cast: the layer returns bf16
    assert got.dtype == torch.bfloat16
    bf = lambda t: t.bfloat16().double()  # noqa: E731  the rounded operands, multiplied exactly
    want = F.linear(bf(x), bf(w), bf(b))
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=2e-2)  # bf16's own rounding of the output


@pytest.mark.parametrize("shape", [(1, 24), (1, 1, 24), (5, 24), (3, 7, 24)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch_hint", [1, 4])
def test_upcast_multiplies_bf16_inputs_by_bf16_weights_one_row_as_held_more_in_fp32(
    batch_hint, bias, shape, monkeypatch
):
    """One row: torch's bf16 F.linear on the weight as held (the same call, the same bits). More rows: the
    rounded operands multiplied in fp32, the weight converted a slice at a time (3 slices of 16 output rows
    and one of 8 here, 40 rows: each slice's values the right ones), or, held for batches of 4 where
    oneDNN packs, by its fp32 values packed once."""
    packs = batch_hint > 1 and cannot_run("packed") is None
    monkeypatch.setattr(kernels, "UPCAST_SLICE", 16 * 24 + 5)  # not a whole number of rows either
    monkeypatch.setattr(kernels, "_scratch", threading.local())  # a buffer of that size
    wide = DecodeLinear(torch.ones(3, 500), None, "upcast", torch.bfloat16)  # a row wider than a slice: one row a slice
    assert wide.slice_rows == 1
    torch.testing.assert_close(wide(torch.ones(2, 500)), torch.full((2, 3), 500.0))
    w, b, x = _layer_inputs(bias, shape)
    layer = DecodeLinear(w, b, "upcast", torch.bfloat16, batch_hint)
    assert layer.weight.dtype == torch.bfloat16 and layer.slice_rows == 16 and (layer.packed is not None) == packs
    monkeypatch.setattr(kernels, "_scratch", threading.local())
    with torch.inference_mode():
        got = layer(x)  # the slices' buffer, where used, made under inference_mode
    with torch.no_grad():  # ... and outside it made again (torch refuses writes to an inference tensor)
        torch.testing.assert_close(layer(x), got, rtol=0, atol=0)
    assert layer(torch.empty(0, 24)).shape == (0, 40)
    assert got.shape == (*shape[:-1], 40)
    bf = lambda t: t.bfloat16().double()  # noqa: E731  the rounded operands, multiplied exactly
    want = F.linear(bf(x), bf(w), None if b is None else bf(b))
    if x.numel() == 24:
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, F.linear(x.bfloat16(), w.bfloat16(), None if b is None else b.bfloat16()))
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=2e-2)
    else:
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)  # fp32 sums of exact products


def test_int8_quantization_is_symmetric_per_row_within_half_a_step():
    w = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    w[2] *= 100  # rows of very different ranges get their own scales
    w[4] = 0.0  # an all-zero row must not divide by zero
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    torch.testing.assert_close(scale[:4], w[:4].abs().amax(dim=1) / 127)
    assert torch.equal(q[4], torch.zeros(50, dtype=torch.int8))
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()
    assert all(int(q[r].abs().max()) == 127 for r in (0, 1, 2, 3, 5))  # each row's largest maps to +-127


@needs_int8
@pytest.mark.parametrize("width", [24, 40, 64, 100])  # widths torch's bf16 kernel gets wrong unpadded, and right
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_multiplies_by_the_dequantized_weight(dtype, width):
    g = torch.Generator().manual_seed(width)
    w, b, x = torch.randn(40, width, generator=g), torch.randn(40, generator=g), torch.randn(3, 7, width, generator=g)
    layer = DecodeLinear(w, b, "int8", dtype)
    q, scale = quantize_int8(w)
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == dtype and got.shape == (3, 7, 40)
    xin = x.to(dtype).double()
    want = F.linear(xin, q.double() * scale.to(dtype).double()[:, None], b.to(dtype).double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


needs_gemv = pytest.mark.skipif(
    gemv_error(torch.device("cpu")) is not None, reason=str(gemv_error(torch.device("cpu")))
)


@needs_gemv
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 7, 9])  # one row; several: groups of four and what is left
@pytest.mark.parametrize("width", [8, 37, 48, 64, 100])  # the 32-wide steps, the 8-wide ones and the tail
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("held", ["int8", "bf16"])
def test_compiled_gemv_multiplies_fp32_inputs_by_the_held_weight(held, rows, width, bias):
    """int8-gemv against the dequantized weight, gemv against the bf16-rounded one, the inputs unrounded
    (fp64 reference); one row through the C kernel, several too (int8) or as upcast does them (bf16),
    and the C kernel's several rows for bf16 as well (the fused step's and the head's path); 45 weight
    rows: pairs of rows and the last alone."""
    g = torch.Generator().manual_seed(rows * 1000 + width)
    w, b = torch.randn(45, width, generator=g), torch.randn(45, generator=g) if bias else None
    x = torch.randn(rows, width, generator=g)
    if held == "int8":
        q, scale = quantize_int8(w)
        exact, layer = q.double() * scale.double()[:, None], DecodeLinear(w, b, "int8-gemv", torch.float32)
    else:
        exact, layer = w.bfloat16().double(), DecodeLinear(w, b, "gemv", torch.bfloat16, batch_hint=rows)
        b = None if b is None else b.bfloat16()  # held in the weight's dtype, as every decode linear's
    want = F.linear(x.double(), exact, None if b is None else b.double())
    for threads in (1, 2):  # rows shared among threads give the same sums
        torch.set_num_threads(threads)
        with torch.inference_mode():
            got = layer(x[None].transpose(0, 1))  # a non-contiguous (rows, 1, width) input
        assert got.dtype == torch.float32 and got.shape == (rows, 1, 45)
        torch.testing.assert_close(got[:, 0].double(), want, rtol=1e-5, atol=1e-5)
        if held == "bf16":
            c = _compiled_gemv("bf16_gemv", x, layer.weight, None, layer.bias32, 45)
            torch.testing.assert_close(c.double(), want, rtol=1e-5, atol=1e-5)
    torch.set_num_threads(1)
    assert layer(torch.empty(0, width)).shape == (0, 45)
    with pytest.raises(ValueError, match="runs in (float32|bfloat16) only, not torch.float16"):
        DecodeLinear(w, b, "int8-gemv" if held == "int8" else "gemv", torch.float16)


@needs_gemv
def test_gemv_multiplies_up_to_its_tile_rows_by_the_compiled_tiles_and_more_rows_as_upcast(monkeypatch):
    """A hold's ``tile_rows`` routes each call by its rows: up to it the compiled GEMV, past it upcast's
    matmul; both the bf16-rounded weight's product (fp64 reference)."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(40, 48, generator=g), torch.randn(2, 3, 48, generator=g)  # 6 rows a call
    layer = DecodeLinear(w, None, "gemv", torch.bfloat16, batch_hint=6)
    want = F.linear(x.double(), w.bfloat16().double())
    seen = []
    monkeypatch.setattr(
        kernels, "_compiled_gemv", lambda *a: seen.append(a[1].numel() // a[1].shape[-1]) or _compiled_gemv(*a)
    )
    for tile_rows, compiled in ((1, []), (5, []), (6, [6]), (64, [6])):
        seen.clear()
        kernels.set_tile_rows(layer, tile_rows)
        with torch.inference_mode():
            got = layer(x)
        assert seen == compiled and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    kernels.set_tile_rows(layer, 0)
    assert layer.tile_rows == 1  # one row is always the compiled GEMV's


@needs_gemv
@pytest.mark.parametrize("dot", [True, False], ids=["bf16-dot-where-the-cpu-has-it", "fp32-routines"])
@pytest.mark.parametrize("k", [64, 48, 100])  # whole 32-weight lines; a part line; an odd part
def test_the_compiled_gemv_multiplies_inputs_rounded_to_bf16_at_any_rows_either_way(dot, k):
    """``round_inputs``: each product that of the inputs rounded to bf16 (fp64 reference of the rounded
    inputs), at 1-9 rows (tiles of four, then three, two or one) and an odd count of weight rows (the last
    alone), by the AVX512_BF16 routines where the CPU has them and by the fp32 ones on the rounded values
    (the other branch, asked for); without it the inputs are not rounded."""
    from gpt2lab.inference import _gemv

    g = torch.Generator().manual_seed(k)
    w, b = torch.randn(41, k, generator=g).bfloat16(), torch.randn(41, generator=g)
    try:
        _gemv.set_bf16_dot(dot)
        assert _gemv.has_bf16_dot() == (dot and "avx512_bf16" in runtime.cpu_flags())
        for m in range(1, 10):
            x = torch.randn(m, k, generator=g)
            got = _compiled_gemv("bf16_gemv", x, w, None, b, 41, True)
            want = F.linear(x.bfloat16().double(), w.double(), b.double())
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
            assert (got.double() - F.linear(x.double(), w.double(), b.double())).abs().max() > 1e-5
            unrounded = _compiled_gemv("bf16_gemv", x, w, None, b, 41)
            plain = F.linear(x.double(), w.double(), b.double())
            torch.testing.assert_close(unrounded.double(), plain, rtol=1e-5, atol=1e-5)
    finally:
        _gemv.set_bf16_dot(True)


def unpack_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """``pack_panels``' inverse, written for these tests: the (n, in) weight."""
    groups, half = panels.shape[:2]
    return panels.permute(0, 2, 3, 1, 4).reshape(groups * kernels.PANEL_OUT, 2 * half)[:n]


def test_panels_place_each_weight_where_the_kernel_reads_it():
    """pack_panels against its layout written out: weight (32g + 16p + o, 2q + t) at [g, q, p, o, t], the
    outputs padded with zeros to a whole group; unpack_panels gives the weight back; an odd width refused."""
    w = torch.randn(45, 6).bfloat16()
    panels = kernels.pack_panels(w)
    assert panels.shape == (2, 3, 2, 16, 2) and panels.dtype == torch.bfloat16
    for g, q, p, o, t in [(0, 0, 0, 0, 0), (0, 2, 1, 15, 1), (1, 1, 0, 12, 0), (0, 1, 1, 3, 1)]:
        assert panels[g, q, p, o, t] == w[32 * g + 16 * p + o, 2 * q + t]
    assert not panels[1, :, 0, 13:].any() and not panels[1, :, 1].any()  # outputs 45-63: padding
    assert torch.equal(unpack_panels(panels, 45), w)
    with pytest.raises(ValueError, match="even number of inputs, not 7"):
        kernels.pack_panels(torch.zeros(4, 7))


@needs_gemv
@pytest.mark.parametrize("dot", [True, False], ids=["bf16-dot-where-the-cpu-has-it", "plain-c"])
@pytest.mark.parametrize("n, k", [(45, 64), (41, 100), (32, 2), (16, 48), (70, 768)])
def test_panels_multiply_rounded_inputs_at_any_rows_and_a_row_alone_as_in_a_batch_or_a_prompt(dot, n, k, monkeypatch):
    """A panel hold: each product that of the inputs rounded to bf16 (fp64 reference), at 1-17 rows (tiles of
    eight, then what is left), outputs not a whole group, by the AVX512_BF16 routines where they run and by
    the plain C loops (asked for); each row's outputs the same bits alone, in a batch, as a prompt's tokens
    and on one thread or two."""
    from gpt2lab.inference import _gemv

    g = torch.Generator().manual_seed(n * k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    monkeypatch.setattr(kernels, "panels_run", lambda k: True)  # panels, whose plain C loops run anywhere
    layer = DecodeLinear(w, b, "gemv", torch.bfloat16, bf16_inputs=True)
    assert layer.extra_repr().endswith("gemv bfloat16") and torch.equal(unpack_panels(layer.panels, n), w.bfloat16())
    try:
        _gemv.set_bf16_dot(dot)
        for m in (1, 2, 8, 9, 17):
            x = torch.randn(m, k, generator=g)
            want = F.linear(x.bfloat16().double(), w.bfloat16().double(), b.bfloat16().double())
            outs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                with torch.inference_mode():
                    outs += [layer(x), torch.cat([layer(x[i : i + 1]) for i in range(m)]), layer(x[None])[0]]
            assert outs[0].dtype == torch.float32 and outs[0].shape == (m, n)
            torch.testing.assert_close(outs[0].double(), want, rtol=1e-5, atol=1e-5)
            assert all(torch.equal(o, outs[0]) for o in outs[1:])
    finally:
        _gemv.set_bf16_dot(True)
        torch.set_num_threads(1)
    with pytest.raises(ValueError, match="runs in bfloat16 only"):
        DecodeLinear(w, b, "gemv", torch.float32, bf16_inputs=True)


@pytest.mark.parametrize("runs", [True, False])
def test_a_gemv_hold_with_rounded_inputs_takes_panels_where_they_run_and_the_width_is_even(monkeypatch, runs):
    """DecodeLinear: panels for a bf16 ``gemv`` linear with rounded inputs where the AVX512_BF16 routines run
    (faked either way) and its inputs are even; row-major otherwise, and for unrounded inputs."""
    monkeypatch.setattr(kernels, "panels_run", lambda k: runs and k % 2 == 0)
    for width, inputs, panels in ((48, True, runs), (47, True, False), (48, False, False)):
        lin = nn.Linear(width, 40)
        layer = DecodeLinear(lin.weight, lin.bias, "gemv", torch.bfloat16, bf16_inputs=inputs)
        assert (layer.panels is not None, layer.weight is None) == (panels, panels) and layer.bf16_inputs == inputs


@needs_gemv
def test_gemv_with_bf16_inputs_rounds_every_route_and_runs_a_prompt_past_its_tiles_by_the_bf16_matmul():
    """``bf16_inputs``: a prompt's tokens past the tiles are oneDNN's bf16 matmul (fp64 reference of the
    rounded inputs, to the output's bf16 rounding); a batch of new tokens past the tiles, and rows up to
    them, are the rounded inputs' products in fp32 (to 1e-5); no fp32 copy is packed. Without it, every
    route multiplies the unrounded inputs."""
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(40, 48, generator=g), torch.randn(40, generator=g)
    prompt, batch = torch.randn(1, 6, 48, generator=g), torch.randn(6, 1, 48, generator=g)
    wb, bb = w.bfloat16().double(), b.bfloat16().double()
    ref = lambda x, rounded: F.linear((x.bfloat16() if rounded else x).double(), wb, bb)  # noqa: E731
    for rounded in (True, False):
        layer = DecodeLinear(w, b, "gemv", torch.bfloat16, batch_hint=6, bf16_inputs=rounded)
        assert (layer.packed is None) == rounded or kernels.cannot_run("packed") is not None
        for tile_rows in (1, 6):  # past the tiles; through them
            kernels.set_tile_rows(layer, tile_rows)
            with torch.inference_mode():
                got_prompt, got_batch = layer(prompt), layer(batch)
            assert got_prompt.dtype == got_batch.dtype == torch.float32
            exact = not rounded or tile_rows == 6  # the bf16 matmul rounds its output
            tol = 1e-5 if exact else 8e-3
            torch.testing.assert_close(got_prompt.double(), ref(prompt, rounded), rtol=tol, atol=tol)
            torch.testing.assert_close(got_batch.double(), ref(batch, rounded), rtol=1e-5, atol=1e-5)
        assert ((got_batch.double() - ref(batch, False)).abs().max() > 1e-4) == rounded  # the rounding shows


@needs_gemv
@pytest.mark.parametrize("flags, native", [(("avx512_bf16", "avx2", "fma"), True), (("avx2", "fma"), False)])
def test_bench_precision_measures_gemv_with_fp32_inputs_too_where_the_default_rounds_them(monkeypatch, flags, native):
    from gpt2lab.benchmarks import precision

    monkeypatch.setattr(runtime, "cpu_flags", lambda: flags)
    ways = precision._ways("packed", torch.device("cpu"))
    assert ways["bfloat16_gemv"] == Candidate("bfloat16", "gemv")
    assert (ways.get(precision.FP32_INPUTS) == Candidate("bfloat16", "gemv")) == native


@pytest.mark.parametrize("flags, native", [(("avx512_bf16", "avx512f", "avx2", "fma"), True), (("avx2", "fma"), False)])
def test_a_gemv_hold_rounds_its_inputs_to_bf16_where_the_cpu_computes_bf16_natively(monkeypatch, flags, native):
    """The hold and the decision follow the same fact (faked CPU flags), and the decision says so."""
    from gpt2lab.system import runtime

    monkeypatch.setattr(runtime, "cpu_flags", lambda: flags)
    held = hold(tiny_gpt(seed=1), Candidate("bfloat16", "gemv"))
    linears = [m for m in held.modules() if isinstance(m, DecodeLinear)]
    assert linears and {m.bf16_inputs for m in linears} == {native}
    # panels where the inputs are rounded and the compiled AVX512_BF16 routines run (the real CPU's fact)
    assert {m.route for m in linears} == {"panels" if native and kernels.panels_run(64) else "gemv"}
    request = InferenceRequest(dtype="bfloat16")
    for kernel in ("gemv", "upcast"):  # the one measured is chosen
        timings = {f"bfloat16/{kernel}": Timing(prefill=10.0, step1=1.0)}
        facts = Facts("cpu", cpu_flags=NATIVE * native, kernels={**ONEDNN, "gemv": None}, timings=timings)
        d = choose(request, facts)
        ours = kernel == "gemv" and native
        assert d.candidate.kernel == kernel and d.bf16_inputs == ours and d.record()["bf16_inputs"] == ours
        assert ("inputs rounded to bf16" in d.summary()) == ours


@pytest.mark.parametrize(
    "short, long, rows",
    [
        # the tiles 50 ms ahead at 16 tokens, 100 behind at 128: the lead falls 150 ms over 112 tokens,
        # to zero at 16 + 50 * 112 / 150 = 53.3 tokens
        ((90.0, 40.0), (300.0, 400.0), 53),
        ((90.0, 40.0), (300.0, 290.0), 128),  # ahead at both: as far as measured, no further
        ((90.0, 40.0), (300.0, 200.0), 128),  # ahead and gaining
        ((50.0, 60.0), (300.0, 250.0), 1),  # behind at 16, gaining later: not a prefix, upcast
        # behind 10 at 16, 200 at 128: the lead falls 190 over 112 tokens, zero at 16 - 10 * 112 / 190 = 10.1
        ((50.0, 60.0), (300.0, 500.0), 10),
        ((50.0, 100.0), (300.0, 500.0), 1),  # zero at 16 - 50 * 112 / 150 = -21: never ahead
    ],
)
def test_the_tiles_stop_where_their_measured_line_crosses_upcasts(short, long, rows):
    from gpt2lab.inference.choice import crossover

    assert crossover(short, long, (16, 128)) == rows


@needs_gemv
def test_the_probe_measures_where_the_tiles_stop_and_every_hold_of_the_choice_keeps_it(tmp_path, monkeypatch):
    """The real probe gives a ``gemv`` candidate its ``tile_rows`` within what it measured; from the cache,
    a decision's (and ``for_inference``'s) hold multiplies that many rows by the tiles, and the probe's own
    later figures of the candidate are taken held so."""
    monkeypatch.setattr(kernels, "panels_run", lambda k: False)  # a hold with tiles, where panels would not
    model = tiny_gpt(seed=1, vocab_size=97, block_size=64)
    cpu, gemv = torch.device("cpu"), Candidate("bfloat16", "gemv")
    t = prep.measure(model, gemv, InferenceRequest(rows=1), cpu, figures=prep.FIGURES + ("tile_rows",))
    assert 1 <= t.tile_rows <= 64 and t.prefill > 0 and t.step1 > 0
    assert prep.measure(model, Candidate("bfloat16", "upcast"), InferenceRequest(), cpu).tile_rows is None

    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("GPT2LAB_PROBE", raising=False)
    held_with = {}

    def fake(model, cand, request, device, best=None, figures=prep.FIGURES, doubts=None, tile_rows=1):
        held_with.setdefault(cand.name, []).append(tile_rows)
        if "prefill" not in figures:
            return Timing(step_batch=1.0, step_rows=1.0)
        fast = cand.kernel == "gemv"
        return Timing(
            1.0 if fast else 9.0, 1.0 if fast else 9.0, tile_rows=7 if fast and "tile_rows" in figures else None
        )

    monkeypatch.setattr(prep, "measure", fake)
    facts = dataclasses.replace(prep.detect_facts(cpu), cpu_flags=NATIVE)  # both dtypes measured
    decision = prep.decide(model, cpu, InferenceRequest(), facts=facts)
    assert decision.candidate == gemv and decision.tile_rows == 7 and "by its tiles up to 7" in decision.summary()
    assert held_with["bfloat16/gemv"] == [1, 7, 7]  # first measured; again and at 16 rows held with its tiles
    assert decision.record()["tile_rows"] == 7
    [entry] = runtime.cached().values()
    assert "bfloat16/gemv: prefill 1 ms, one-row step 1 ms, its tiles up to 7 rows" in entry_lines(entry)
    tiles = lambda m: {x.tile_rows for x in m.modules() if isinstance(x, DecodeLinear)}  # noqa: E731
    assert tiles(hold(model, decision.candidate, tile_rows=decision.tile_rows)) == {7}
    monkeypatch.setattr(prep, "detect_facts", lambda device: facts)
    import gpt2lab.inference.form as form

    monkeypatch.setattr(form, "detect_facts", lambda device: facts)
    assert tiles(for_inference(model, dtype="auto")) == {7}  # read from the cache, not measured
    assert tiles(hold(model, decision.candidate)) == {1}  # unmeasured: one row only


@needs_gemv
def test_a_panel_hold_has_no_tiles_to_measure(monkeypatch):
    """A ``gemv`` hold in panels takes every row count by its kernel: the probe times its prefill once and
    gives it no ``tile_rows``."""
    import gpt2lab.inference.form as form

    monkeypatch.setattr(kernels, "panels_run", lambda k: k % 2 == 0)
    monkeypatch.setattr(form, "gemv_bf16_inputs", lambda facts: True)  # a CPU with native bf16
    monkeypatch.setattr(prep, "_tiles", lambda *a: pytest.fail("a panel hold's tiles were timed"))
    model = tiny_gpt(seed=1, vocab_size=97, block_size=64)
    held = hold(model, Candidate("bfloat16", "gemv"))
    assert not kernels.tiled(held) and any(getattr(m, "route", "") == "panels" for m in held.modules())
    t = prep.measure(model, Candidate("bfloat16", "gemv"), InferenceRequest(), torch.device("cpu"),
                     figures=prep.FIGURES + ("tile_rows",))  # fmt: skip
    assert t.tile_rows is None and t.prefill > 0 and t.step1 > 0


def test_the_probe_cache_keeps_a_builds_figures_apart(monkeypatch):
    """The probe's entry for a model on this machine names the compiled kernel's build: figures measured
    with one build are not read for another."""
    model = tiny_gpt(seed=1, vocab_size=97, block_size=64)
    keys = set()
    for build in ("aaaa", "bbbb", "aaaa"):
        monkeypatch.setattr("gpt2lab.inference.form.compiled_build", lambda: build)
        keys.add(cache_key(model.config, torch.device("cpu"), ["bfloat16/gemv"]))
    assert len(keys) == 2
    assert kernels.compiled_build() != "none" or gemv_error(torch.device("cpu")) is not None


def test_compiled_gemv_says_why_it_cannot_run(monkeypatch):
    """Not compiled (no C compiler at install), a CPU without AVX2, another device: one reason each."""
    assert "CPU kernel" in gemv_error(torch.device("cuda"))
    monkeypatch.setattr(kernels, "_gemv", None)  # what an install without it gives (its import failed)
    assert "not built" in gemv_error(torch.device("cpu"))
    monkeypatch.undo()
    if gemv_error(torch.device("cpu")) is None:
        from gpt2lab.inference import _gemv

        monkeypatch.setattr(_gemv, "has_avx2", lambda: False)
        assert "no AVX2" in gemv_error(torch.device("cpu"))


def _exact_reference(model, held: str):
    """``model`` held as plain fp32 linears whose weights are the values the compiled kernel multiplies."""
    reference = hold(model, Candidate("float32", "plain"))
    with torch.no_grad():
        for m in reference.modules():
            if isinstance(m, DecodeLinear):
                if held == "int8":
                    q, scale = quantize_int8(m.weight)
                    m.weight.copy_(q.float() * scale[:, None])
                else:
                    m.weight.copy_(m.weight.bfloat16().float())
                    if m.bias is not None:
                        m.bias.copy_(m.bias.bfloat16().float())
    return reference


@needs_gemv
@pytest.mark.parametrize("block", [{}, MODERN], ids=["gpt2", "modern"])
@pytest.mark.parametrize("cand", [Candidate("float32", "int8-gemv"), Candidate("bfloat16", "gemv")], ids=str)
def test_a_compiled_gemv_model_gives_the_exact_weights_logits_and_greedy_tokens(cand, block, monkeypatch):
    """Every linear through the compiled kernel against the model whose weights are the held values
    (int8 dequantized, bf16 rounded) as plain fp32 linears: prefill, a batch of rows, decoding through
    the KV cache (GPT-2's block: the fused step, one call a token), greedy tokens equal. A prompt's rows
    in fp32 too, as on a CPU without native bf16 (with it, the bf16 matmul's own test above)."""
    from gpt2lab.inference import _gemv
    from gpt2lab.model.sampling import generate

    calls = []
    step = _gemv.model_step
    monkeypatch.setattr(_gemv, "model_step", lambda *a: (calls.append(a), step(*a))[1])
    model = tiny_gpt(seed=4, vocab_size=97, block_size=32, **block)
    idx = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(2))
    ready = hold(model, cand, rows=3, bf16_inputs=False)
    reference = _exact_reference(model, "int8" if cand.kernel == "int8-gemv" else "bf16")
    with torch.inference_mode():
        want, _ = reference(idx)
        got, _ = ready(idx)
        steps = []
        for m in (ready, reference):
            cache = m.new_kv_cache(16)
            m(idx[:1, :6], kv_cache=cache)
            steps.append(torch.cat([m(idx[:1, t : t + 1], kv_cache=cache)[0] for t in range(6, 11)], dim=1))
        tokens = [generate(m, idx[:1, :5], 20, temperature=0.0) for m in (ready, reference)]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(steps[0], steps[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(steps[0][0], want[0, 6:], rtol=1e-4, atol=1e-4)
    assert torch.equal(tokens[0], tokens[1])
    assert {m.kernel for m in ready.modules() if isinstance(m, DecodeLinear)} == {cand.kernel}
    assert ready.fused == (not block)
    # GPT-2's block: each one-token step of one row after the prompt, fused (5 steps, then 19 of generate's 20)
    assert len(calls) == (0 if block else 5 + 19)


@pytest.mark.parametrize(
    "block", [{}, MODERN, dict(MODERN, value_embeds=1, unet_skips=True)], ids=["gpt2", "modern", "levers"]
)
@pytest.mark.parametrize("kernel", ["decode", "packed"])
def test_a_prepared_fp32_model_gives_the_models_logits_and_shares_its_other_weights(block, kernel):
    if kernel == "packed" and cannot_run("packed"):
        pytest.skip("this torch build has no oneDNN packed linear")
    model = tiny_gpt(seed=3, vocab_size=97, block_size=32, **block)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    idx = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, _ = model(idx)
        ready = hold(model, Candidate("float32", kernel), rows=4)
        got, _ = ready(idx)
        cache = ready.new_kv_cache(16)  # decoding through the KV cache, one token at a time
        ready(idx[:1, :10], kv_cache=cache)
        last, _ = ready(idx[:1, 10:], kv_cache=cache, last_only=True)
        _, loss = ready(idx, idx, return_logits=False)  # the eval loss: from whole logits, not the chunked path
        _, want_loss = model(idx, idx)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last[0, -1], want[0, -1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    assert sum(isinstance(m, torch.nn.Linear) for m in model.modules()) == n_linear  # the model is untouched
    assert not any(isinstance(m, torch.nn.Linear) for m in ready.modules())
    assert ready.transformer.wte.weight is model.transformer.wte.weight  # shared, not copied
    assert {(m.kernel, m.dtype) for m in ready.modules() if isinstance(m, DecodeLinear)} == {(kernel, torch.float32)}
    assert not ready.training
    assert all(p.requires_grad for p in model.parameters())  # the model still trains


@pytest.mark.parametrize("kernel, rows", [("plain", 1), ("upcast", 1), ("upcast", 4)])
def test_a_bf16_prepared_model_keeps_an_fp32_residual_stream_and_an_fp32_attention_on_a_cpu(kernel, rows):
    """bf16 weights: each linear's output adds into the fp32 residual, as under autocast; on a CPU the
    attention, and so the KV cache, runs in fp32; the logits are those of the bf16-rounded weights within
    bf16's rounding of the activations."""
    model = tiny_gpt(seed=4, vocab_size=97, block_size=32)
    rounded = tiny_gpt(seed=4, vocab_size=97, block_size=32)
    with torch.no_grad():
        for name, m in rounded.named_modules():
            if isinstance(m, torch.nn.Linear) and name != "lm_head":
                m.weight.copy_(m.weight.bfloat16().float())
                m.bias.copy_(m.bias.bfloat16().float())
    idx = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ready = hold(model, Candidate("bfloat16", kernel), rows)
        cache = ready.new_kv_cache(10)
        got, _ = ready(idx, kv_cache=cache)
        step, _ = ready(idx[:, :1], kv_cache=cache)  # one more position: one row at a time through the cache
        want, _ = rounded(idx)
        want_step, _ = rounded(torch.cat([idx, idx[:, :1]], 1))
    assert cache.k[0].dtype == torch.float32 and cache.v[0].dtype == torch.float32
    assert got.dtype == (torch.bfloat16 if kernel == "plain" else torch.float32)  # several rows in fp32
    torch.testing.assert_close(step[:, -1].float(), want_step[:, -1], rtol=0, atol=0.05 * float(want.abs().max()))
    assert model.transformer.wte.weight.dtype == torch.float32
    torch.testing.assert_close(got.float(), want, rtol=0, atol=0.05 * float(want.abs().max()))


def test_swap_linears_gives_a_tied_head_its_own_copy():
    model = tiny_gpt(seed=1, vocab_size=97, block_size=16)
    wte = model.transformer.wte.weight.clone()
    assert swap_linears(model, "int8" if cannot_run("int8") is None else "plain", torch.float32) == 9
    assert torch.equal(model.transformer.wte.weight, wte)  # the embedding still reads the shared table


# -- the choice, with faked facts -------------------------------------------------------------
NATIVE = ("avx512_bf16",)  # a CPU flag of native bf16
ONEDNN = dict.fromkeys(("packed", "bfloat16/packed", "int8"))  # the kernels that run (None: no reason not to)
ZEN = Facts("cpu", "AMD EPYC (Zen 4)", NATIVE, kernels=ONEDNN)
XEON = Facts("cpu", "Intel Xeon (AVX-512, no AVX512_BF16)", kernels=ONEDNN)
NO_BF16_PACKING = "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl"
AVX2 = Facts("cpu", "AMD EPYC (AVX2 only)", kernels={**ONEDNN, "bfloat16/packed": NO_BF16_PACKING + " and avx512dq"})
GEMV = dataclasses.replace(AVX2, kernels={**AVX2.kernels, "gemv": None})  # gpt2lab's compiled GEMV built, AVX2 there
ZEN_GEMV = dataclasses.replace(ZEN, kernels={**ONEDNN, "gemv": None})
NO_ONEDNN = Facts("cpu", "a CPU build without oneDNN", kernels={"int8": None})
H100 = Facts("cuda", "NVIDIA H100", cuda_bf16=True, kernels={"int8": "no CUDA int8 weight-only kernel"})
V100 = Facts("cuda", "Tesla V100")
MPS = Facts("mps", "Apple MPS")


def test_bf16_packing_fact_is_what_onednn_does():
    """cannot_run("packed", bfloat16) says None exactly where a bf16 packed DecodeLinear builds and matches
    F.linear."""
    if cannot_run("packed"):
        pytest.skip("no oneDNN packed linear in this torch build")
    torch.manual_seed(0)
    w, b, x = torch.randn(48, 32), torch.randn(48), torch.randn(3, 32)
    if cannot_run("packed", torch.bfloat16) is None:
        got = DecodeLinear(w, b, "packed", torch.bfloat16, 3)(x.bfloat16()).float()
        want = F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()).float()
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
    else:
        with pytest.raises(RuntimeError):
            DecodeLinear(w, b, "packed", torch.bfloat16, 3)


def _names(cands):
    return [c.name for c in cands]


@pytest.mark.parametrize(
    "facts, request_, want",
    [
        (
            ZEN,
            InferenceRequest(),
            [
                "float32/plain",
                "float32/decode",
                "float32/packed",
                "bfloat16/plain",
                "bfloat16/decode",
                "bfloat16/upcast",
                "bfloat16/packed",
            ],
        ),
        (
            NO_ONEDNN,
            InferenceRequest(),
            ["float32/plain", "float32/decode", "bfloat16/plain", "bfloat16/decode", "bfloat16/upcast"],
        ),
        (AVX2, InferenceRequest(dtype="float32", linear="packed"), ["float32/packed"]),
        (
            AVX2,
            InferenceRequest(),
            [
                "float32/plain",
                "float32/decode",
                "float32/packed",  # oneDNN packs no bf16 there
                "bfloat16/plain",
                "bfloat16/decode",
                "bfloat16/upcast",  # fp32 needs no converting
            ],
        ),
        (XEON, InferenceRequest(dtype="bfloat16", linear="plain"), ["bfloat16/plain", "bfloat16/decode"]),
        (
            GEMV,
            InferenceRequest(),
            [
                "float32/plain",
                "float32/decode",
                "float32/packed",
                "bfloat16/plain",
                "bfloat16/decode",
                "bfloat16/upcast",
                "bfloat16/gemv",  # bf16 weights only: fp32 ones need no widening
            ],
        ),
        (GEMV, InferenceRequest(dtype="bfloat16", linear="plain"), ["bfloat16/plain", "bfloat16/decode"]),
        (ZEN, InferenceRequest(quantize="int8"), ["float32/int8", "bfloat16/int8"]),
        (GEMV, InferenceRequest(quantize="int8"), ["float32/int8", "float32/int8-gemv", "bfloat16/int8"]),
        (GEMV, InferenceRequest(quantize="int8", dtype="bfloat16"), ["bfloat16/int8"]),  # it computes in fp32
        (GEMV, InferenceRequest(quantize="int8", dtype="float32"), ["float32/int8", "float32/int8-gemv"]),
        (H100, InferenceRequest(), ["float32/plain", "bfloat16/plain"]),
        (V100, InferenceRequest(), ["float32/plain", "float16/plain"]),
        (V100, InferenceRequest(dtype="float16"), ["float16/plain"]),
        (MPS, InferenceRequest(), ["float32/plain", "float16/plain"]),
    ],
)
def test_candidates_are_what_the_device_runs_and_the_request_allows(facts, request_, want):
    assert _names(candidates(request_, facts)) == want


@pytest.mark.parametrize(
    "facts, request_, needle",
    [
        (ZEN, InferenceRequest(dtype="float16"), "--dtype float16 needs a GPU"),
        (V100, InferenceRequest(dtype="bfloat16"), "has no bf16"),
        (H100, InferenceRequest(quantize="int8"), "--quantize int8 cannot run here: no CUDA int8"),
        (NO_ONEDNN, InferenceRequest(linear="packed"), "--cpu-linear packed cannot run here"),
        (
            AVX2,
            InferenceRequest(dtype="bfloat16", linear="packed"),
            "--dtype bfloat16 --cpu-linear packed cannot run here",
        ),
        (H100, InferenceRequest(linear="packed"), "--cpu-linear packed cannot run here"),
        (ZEN, InferenceRequest(quantize="int4"), "--quantize int4"),
    ],
)
def test_what_cannot_run_is_one_line_naming_the_flag(facts, request_, needle):
    with pytest.raises(ChoiceError, match=needle):
        candidates(request_, facts)


@pytest.mark.parametrize(
    "facts, request_, want",
    [
        (ZEN, InferenceRequest(), "bfloat16/packed"),
        (XEON, InferenceRequest(), "float32/packed"),
        (AVX2, InferenceRequest(workload="serve", rows=8), "float32/packed"),
        (NO_ONEDNN, InferenceRequest(), "float32/decode"),
        (ZEN, InferenceRequest(quantize="int8"), "bfloat16/int8"),
        (XEON, InferenceRequest(quantize="int8"), "float32/int8"),
        (GEMV, InferenceRequest(quantize="int8"), "float32/int8-gemv"),
        (GEMV, InferenceRequest(), "bfloat16/gemv"),  # no native bf16, but the GEMV's half the bytes and fp32 tiles
        (GEMV, InferenceRequest(workload="serve", rows=8), "bfloat16/gemv"),
        (
            dataclasses.replace(XEON, kernels={**ONEDNN, "gemv": None}),
            InferenceRequest(),
            "bfloat16/gemv",
        ),  # before emulated packed
        (GEMV, InferenceRequest(dtype="bfloat16"), "bfloat16/gemv"),  # upcast's batches, a faster one row
        (ZEN_GEMV, InferenceRequest(), "bfloat16/gemv"),  # native bf16 too: the GEMV's one row, bf16 prompts
        (ZEN_GEMV, InferenceRequest(workload="serve", rows=8), "bfloat16/gemv"),
        (H100, InferenceRequest(), "bfloat16/plain"),
        (V100, InferenceRequest(), "float16/plain"),
        (MPS, InferenceRequest(), "float32/plain"),
    ],
)
def test_unmeasured_the_devices_facts_decide(facts, request_, want):
    d = choose(request_, facts)
    assert d.candidate.name == want and "not measured" in d.reason


def test_one_candidate_needs_no_measuring():
    d = choose(InferenceRequest(dtype="float32", linear="packed"), ZEN)
    assert d.candidate.name == "float32/packed" and d.reason == "asked for"


def _facts(base: Facts, **timings) -> Facts:
    return dataclasses.replace(base, timings={k.replace("__", "/"): v for k, v in timings.items()})


def test_sample_keeps_the_cheapest_request_prefill_plus_its_decode_steps():
    # sample's cost: prefill + 128 one-row steps. bf16/packed: 100 + 128 * 8 = 1124; fp32/packed:
    # 40 + 128 * 9 = 1192 (the faster prefill does not make up for the slower steps); fp32/plain:
    # 40 + 128 * 20 = 2600; others failed or were given up.
    facts = _facts(
        XEON,
        float32__plain=Timing(40.0, 20.0),
        float32__decode="failed: no",
        float32__packed=Timing(40.0, 9.0),
        bfloat16__packed=Timing(100.0, 8.0),
        bfloat16__plain="given up: slow",
        bfloat16__decode="given up: slow",
    )
    d = choose(InferenceRequest(), facts)
    assert d.candidate.name == "bfloat16/packed"
    assert d.reason.startswith(
        "the dtype for every workload, the least behind (a 128-token prefill and 128 steps at one row): "
        "bfloat16 1124.0 ms; against float32 1192.0 ms (1.06x); the kernel least behind as measured for sample: "
        "bfloat16/packed prefill 100.0 / step 8.00 ms"
    )
    assert d.reason.endswith(
        "; dropped: float32/decode failed: no; bfloat16/plain given up: slow; bfloat16/decode given up: slow"
    )
    # the evals score with the prefill alone, where fp32/packed is faster: the dtype is still bf16's
    score = choose(InferenceRequest(workload="score"), facts)
    assert score.candidate.name == "bfloat16/packed"
    assert "the kernel least behind as measured for score: bfloat16/packed prefill 100.0 ms" in score.reason


def test_serve_keeps_the_candidate_whose_worse_slowdown_at_one_row_or_a_full_batch_is_least():
    # costs (one row: prefill + 128 * step1; batch: prefill + 128 * step8 / 8):
    #   A fp32/packed:  10 + 128 * 10 = 1290,   10 + 128 * 16 / 8 = 266  -> max(1290/1034, 266/138) = 1.93
    #   B bf16/packed:  10 + 128 * 8 = 1034,    10 + 128 * 24 / 8 = 394  -> max(1.00, 2.86) = 2.86
    #   C bf16/plain:   10 + 128 * 9 = 1162,    10 + 128 * 8 / 8 = 138   -> max(1.12, 1.00) = 1.12
    facts = _facts(
        ZEN,
        float32__packed=Timing(10.0, 10.0, 16.0),
        bfloat16__packed=Timing(10.0, 8.0, 24.0),
        bfloat16__plain=Timing(10.0, 9.0, 8.0),
    )
    d = choose(InferenceRequest(workload="serve", rows=8), facts)
    assert d.candidate.name == "bfloat16/plain" and "(2.86x)" in d.reason
    assert "against float32 1290.0 ms (1.25x)" in d.reason  # the dtype: bf16's best request, 1034 ms
    assert choose(InferenceRequest(workload="sample"), facts).candidate.name == "bfloat16/packed"


def test_the_dtype_is_one_for_every_workload_only_the_kernel_follows_the_workload():
    """Figures that chose fp32 for sample and bf16 for serve (a batch step of fp32/packed 5x bf16's)
    now choose one dtype for both (and for score): the one whose best request at one row is cheapest.
    Within it the kernel still follows the workload: serve takes fp32/plain, whose batch step is best.
      reference (prefill + 128 * step1): fp32/packed 10 + 1024 = 1034, fp32/plain 10 + 1088 = 1098,
      bf16/packed 10 + 1152 = 1162 -> float32.
      before: serve's worse slowdown (one row; batch prefill + 128 * step8 / 8): fp32/packed
      max(1, 650/170 = 3.82), bf16/packed max(1.12, 1) -> bf16. Now, within fp32: fp32/packed
      max(1, 650/202 = 3.22), fp32/plain max(1098/1034 = 1.06, 1) -> fp32/plain."""
    facts = _facts(
        ZEN,
        float32__packed=Timing(10.0, 8.0, 40.0),
        float32__plain=Timing(10.0, 8.5, 12.0),
        bfloat16__packed=Timing(10.0, 9.0, 10.0),
    )
    picks = {
        w: choose(InferenceRequest(workload=w, rows=8 if w == "serve" else 1), facts).candidate
        for w in ("sample", "serve", "score")
    }
    assert {c.dtype for c in picks.values()} == {"float32"}
    assert picks["sample"].name == "float32/packed" and picks["serve"].name == "float32/plain"
    # the old rule, one cost per workload across every dtype, would have split them
    slow = {n: max(a, b) for n, (a, b) in {"fp32": (1.0, 650 / 170), "bf16": (1162 / 1034, 1.0)}.items()}
    assert min(slow, key=slow.get) == "bf16"


def test_an_asked_half_precision_unmeasured_is_held_on_a_cpu_without_native_bf16():
    """The device's rule prefers fp32 on such a CPU, but an asked --dtype bfloat16 is the only dtype there is."""
    for facts in (XEON, AVX2):
        d = choose(InferenceRequest(dtype="bfloat16"), facts)
        assert d.candidate == Candidate("bfloat16", "packed" if not facts.cannot("bfloat16/packed") else "upcast")
    assert choose(InferenceRequest(), XEON).candidate == Candidate("float32", "packed")
    # without oneDNN: fp32 weights column-major, half-precision ones upcast (fp32 products for several rows)
    assert choose(InferenceRequest(), NO_ONEDNN).candidate == Candidate("float32", "decode")
    assert choose(InferenceRequest(dtype="bfloat16"), NO_ONEDNN).candidate == Candidate("bfloat16", "upcast")
    # with native bf16, an unmeasured half precision keeps its own matmuls
    assert choose(InferenceRequest(dtype="bfloat16", linear="plain"), ZEN).candidate == Candidate("bfloat16", "plain")


def test_the_probe_is_cached_per_machine_and_model_and_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("GPT2LAB_PROBE", raising=False)
    calls = []

    def fake_measure(model, cand, request, device, best=None, figures=prep.FIGURES, doubts=None, tile_rows=1):
        calls.append(cand.name)
        if figures == ("step_batch",):
            return Timing(step_batch=1.5)
        return Timing(1.0, 2.0 if cand.dtype == "float32" else 1.0)

    monkeypatch.setattr(prep, "measure", fake_measure)
    model, cpu = tiny_gpt(seed=0, vocab_size=97, block_size=16), torch.device("cpu")
    request = InferenceRequest(linear="plain")
    first = prep.decide(model, cpu, request, facts=ZEN)
    # 4 candidates, then the best of each dtype again and at 16 rows: 8 calls; a tie between kernels: the
    # first by name
    assert first.candidate.name == "bfloat16/decode" and len(calls) == 8
    assert prep.decide(model, cpu, request, facts=ZEN) == first and len(calls) == 8  # read back, not measured
    [entry] = json.loads((tmp_path / runtime.PROBE_FILE).read_text())["entries"].values()
    assert entry["timings"]["float32/decode"] == {
        "prefill": 1.0,
        "step1": 2.0,
        "step_rows": None,
        "step_batch": None,
        "tile_rows": None,
    }
    assert entry["timings"]["float32/plain"]["step_batch"] == 1.5  # the dtype's best kernel (the first of a tie)
    assert entry["model"] == {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 97, "block_size": 16}
    assert entry["choices"] == {"sample": "bfloat16/decode"} and entry["device"] == "cpu"
    other = tiny_gpt(seed=0, vocab_size=97, block_size=16, n_layer=3)  # another shape: measured anew
    prep.decide(other, cpu, request, facts=ZEN)
    assert len(calls) == 16
    monkeypatch.setenv("GPT2LAB_PROBE", "fresh")  # measured again, and kept
    prep.decide(other, cpu, request, facts=ZEN)
    assert len(calls) == 24
    monkeypatch.setenv("GPT2LAB_PROBE", "0")
    assert "not measured" in prep.decide(other, cpu, request, facts=ZEN).reason and len(calls) == 24


def test_the_tests_keep_gpt2labs_cache_out_of_the_users_home():
    """tests/conftest.py points GPT2LAB_CACHE at a directory of the session, for this process and
    the processes the tests start (a test run must not fill ~/.cache/gpt2lab)."""
    import os
    import subprocess
    import sys

    from gpt2lab.system.env import cache_dir

    home = os.path.realpath(os.path.expanduser("~")) + os.sep
    child = subprocess.run(
        [sys.executable, "-c", "from gpt2lab.system.env import cache_dir; print(cache_dir())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    for where in (cache_dir(), child):
        assert not os.path.realpath(where).startswith(home), where
    assert cache_dir() == child == os.environ["GPT2LAB_TEST_CACHE"] == os.path.dirname(runtime.cache_path())


def test_the_probe_cache_is_one_bounded_versioned_file(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("GPT2LAB_PROBE", raising=False)
    calls = []

    def fake_measure(model, cand, request, device, best=None, figures=prep.FIGURES, doubts=None, tile_rows=1):
        calls.append(cand.name)
        return Timing(1.0, 1.0)

    monkeypatch.setattr(prep, "measure", fake_measure)
    monkeypatch.setattr(runtime, "PROBE_ENTRIES", 3)
    (tmp_path / "notes.json").write_text("{}")  # not the probe's: stays
    keys = []
    request = InferenceRequest(linear="plain")
    names = [c.name for c in candidates(request, ZEN)]
    for n_layer in range(1, 6):  # five shapes, three kept: the two written first are dropped
        model = tiny_gpt(seed=0, vocab_size=97, block_size=16, n_layer=n_layer)
        prep.decide(model, torch.device("cpu"), request, facts=ZEN)
        keys.append(cache_key(model.config, torch.device("cpu"), names))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.json", "probes.json"]
    saved = json.loads((tmp_path / runtime.PROBE_FILE).read_text())
    assert saved["version"] == formats.PROBES.version and sorted(saved["entries"]) == sorted(keys[2:])
    measured = len(calls)
    prep.decide(model, torch.device("cpu"), request, facts=ZEN)
    assert len(calls) == measured  # read back
    for version in (
        formats.PROBES.version - 1,
        formats.PROBES.version + 1,
    ):  # another format: only a cache, measured again
        (tmp_path / runtime.PROBE_FILE).write_text(json.dumps({**saved, "version": version}))
        prep.decide(model, torch.device("cpu"), request, facts=ZEN)
        assert len(calls) == measured + len(names) + 4  # and the best of each dtype again, and at 16 rows
        measured = len(calls)
        assert json.loads((tmp_path / runtime.PROBE_FILE).read_text())["version"] == formats.PROBES.version


def test_a_first_probe_says_once_on_stderr_what_it_does_and_about_how_long(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("GPT2LAB_PROBE", raising=False)
    monkeypatch.setattr(prep, "estimate_seconds", lambda model, n, request, device, n_rows=0: 12.4)
    monkeypatch.setattr(prep, "measure", lambda *a, **k: Timing(1.0, 1.0))  # steady: no other line
    model, cpu = tiny_gpt(seed=0, vocab_size=97, block_size=16), torch.device("cpu")
    prep.decide(model, cpu, InferenceRequest(linear="plain"), facts=ZEN, command="gpt2lab sample")
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "gpt2lab sample: measuring 4 ways to run this model on this machine, about 12 s, once per machine and "
        "model shape (GPT2LAB_PROBE=0 skips it; gpt2lab env lists the figures)"
    ]
    prep.decide(model, cpu, InferenceRequest(linear="plain"), facts=ZEN, command="gpt2lab sample")
    assert capsys.readouterr().err == ""  # read back from the cache: nothing measured, nothing said


def test_the_probe_estimate_counts_the_calls_measure_makes():
    model, cpu = tiny_gpt(seed=0, vocab_size=97, block_size=256), torch.device("cpu")
    clock = iter(range(0, 100, 1))  # each perf_counter() call one "second" later: prefill 1 s, step 1 s

    class FakeTime:
        @staticmethod
        def perf_counter():
            return float(next(clock))

    import unittest.mock as mock

    with mock.patch.object(prep, "time", FakeTime):
        sample = prep.estimate_seconds(model, 2, InferenceRequest(), cpu)
        serve = prep.estimate_seconds(model, 1, InferenceRequest(workload="serve", rows=8), cpu, n_rows=1)
    per = (1 + prep.REPEATS) * (1 + prep.STEPS) + prep.CONTEXT / prep.REQUEST_TOKENS
    rows = (1 + prep.REPEATS) * prep.STEPS * (1 + 8 / prep.REQUEST_TOKENS) + prep.CONTEXT / prep.REQUEST_TOKENS
    assert sample == pytest.approx(2 * per)
    assert serve == pytest.approx(per + rows)


def test_measure_times_a_real_prefill_and_real_steps_and_gives_up_on_a_hopeless_candidate():
    model, cpu = tiny_gpt(seed=0, vocab_size=97, block_size=64), torch.device("cpu")
    every = ("prefill", "step1", "step_rows")
    t = prep.measure(
        model, Candidate("float32", "decode"), InferenceRequest(workload="serve", rows=3), cpu, None, every
    )
    assert all(v is not None and v > 0 for v in (t.prefill, t.step1, t.step_rows))
    assert (
        prep.measure(model, Candidate("float32", "plain"), InferenceRequest(), cpu, figures=("prefill",)).step1 is None
    )
    with pytest.raises(prep._TooSlow, match="not timed further"):
        prep.measure(model, Candidate("float32", "plain"), InferenceRequest(), cpu, best=Timing(prefill=1e-9))


def test_start_up_says_why_each_dropped_candidate_was_dropped():
    """--quantize int8's line named a dropped candidate without a reason: it now gives the figure that
    was too slow against the best one's (measured here on a real model), or the kernel's error."""
    model, cpu = tiny_gpt(seed=0, vocab_size=97, block_size=64), torch.device("cpu")
    request = InferenceRequest(quantize="int8", workload="serve", rows=3)
    every = ("prefill", "step1", "step_rows")
    t = prep.measure(model, Candidate("float32", "plain"), request, cpu, figures=every)
    best = Timing(None, None, t.step_rows / 1e3)  # a 3-row step far ahead of any real one (the only bar: a busy
    # machine cannot give up the prefill or the one-row step first)
    with pytest.raises(prep._TooSlow) as slow:
        prep.measure(model, Candidate("float32", "plain"), request, cpu, best=best, figures=every)
    why = str(slow.value)
    assert why.startswith("float32/plain 3-row step ")
    assert f"against the best candidate's {best.step_rows:.3g} ms (over 10x)" in why
    first = float(why.split()[3])
    assert first > 10 * best.step_rows
    facts = _facts(XEON, bfloat16__int8=t, float32__int8=f"given up: {why}")
    d = choose(request, facts)
    assert d.candidate.name == "bfloat16/int8" and d.reason.endswith(f"; dropped: float32/int8 given up: {why}")
    failed = _facts(XEON, bfloat16__int8=t, float32__int8="failed: no int8 kernel for float32 activations")
    assert choose(request, failed).reason.endswith(
        "; dropped: float32/int8 failed: no int8 kernel for float32 activations"
    )


# -- for_inference(): the library's inference form, by the device's rule -------------------------
def test_for_inference_holds_a_copy_by_the_rule_and_generates_the_models_tokens(tmp_path, monkeypatch):
    from gpt2lab.inference.choice import rule
    from gpt2lab.inference.form import detect_facts
    from gpt2lab.model.sampling import generate

    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path))
    model = tiny_gpt(seed=7, vocab_size=97, block_size=32)
    idx = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(0))
    cpu = torch.device("cpu")
    fast = for_inference(model)
    picked = rule(InferenceRequest(dtype="float32"), detect_facts(cpu)).candidate
    assert fast is not model and picked.dtype == "float32"  # the model's own dtype
    assert {(m.kernel, m.dtype) for m in fast.modules() if isinstance(m, DecodeLinear)} == {
        (picked.kernel, torch.float32)
    }
    assert sum(type(m) is torch.nn.Linear for m in model.modules()) == 9  # the model keeps its own linears
    with torch.inference_mode():
        want = model(idx)[0][:, -1]
        got = fast(idx)[0][:, -1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    greedy = generate(model, idx, 12, temperature=0.0)
    assert torch.equal(greedy, generate(fast, idx, 12, temperature=0.0))
    assert torch.equal(greedy, model.generate(idx, 12, temperature=0.0))
    assert list(tmp_path.iterdir()) == []  # nothing measured, nothing cached
    half = for_inference(model, dtype="bfloat16")
    assert {m.dtype for m in half.modules() if isinstance(m, DecodeLinear)} == {torch.bfloat16}
    with pytest.raises(TypeError, match="for_inference\\(model\\): a gpt2lab GPT"):
        for_inference(torch.nn.Linear(2, 2))


@needs_int8
def test_sample_quantize_int8_continues_as_the_dequantized_weights_do(gpt2_vocab_export, capsys, tmp_path, monkeypatch):
    """`gpt2lab sample --quantize int8` against an independent reference: the fp32 model whose every
    linear weight (the tied head's own copy included; the embedding lookup keeps fp32) is q * scale."""
    import copy

    from gpt2lab import cli
    from gpt2lab.data.tokenizer import gpt2_tokenizer
    from gpt2lab.model.sampling import generate

    model, d = gpt2_vocab_export
    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path))
    assert (
        cli.main(
            [
                "sample",
                "--model",
                d,
                "--prompt",
                "Hello there",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--quantize",
                "int8",
                "--temperature",
                "0",
                "--max-new-tokens",
                "16",
                "--no-stop-at-eot",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    # PyTorch's int8 kernel, or gpt2lab's compiled one where it was built (measured): the same weights
    assert re.search(r"gpt2lab sample: dtype float32, int8(-gemv)? linears", err)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        ref.lm_head.weight = torch.nn.Parameter(ref.lm_head.weight.clone())  # untie: the head alone is quantized
        for m in ref.modules():
            if isinstance(m, torch.nn.Linear):
                q, scale = quantize_int8(m.weight)
                m.weight.copy_(q.float() * scale[:, None])
    enc = gpt2_tokenizer()
    idx = torch.tensor([enc.encode("Hello there")])
    want = generate(ref, idx, 16, temperature=0.0)[0, idx.size(1) :].tolist()
    assert out == f"--- sample 1/1\nHello there{enc.decode(want)}\n"


# -- a measured choice robust to a loaded machine (probe.py) ------------------------------------
class _Clock:
    """time for probe.py: each call of fn lasts the next of ``durations`` seconds (the untimed one first)."""

    def __init__(self, durations):
        self.ends = iter(durations)
        self.now, self.started = 0.0, False

    def perf_counter(self):
        if self.started:  # the end of a call
            self.now += next(self.ends)
        self.started = not self.started
        return self.now


@pytest.mark.parametrize(
    "durations, best, unsteady",
    [
        ([5.0, 1.0, 1.5, 9.0], 1.0, False),  # two of three within 2x of the best: kept
        ([5.0, 1.0, 3.0, 9.0, 2.9, 1.1, 8.0], 1.0, False),  # unsteady, timed again: 1.0 and 1.1 agree
        ([5.0, 2.0, 6.0, 9.0, 7.0, 5.0, 6.0], 2.0, True),  # still 2.5x apart after six calls: not kept
    ],
)
def test_each_figure_is_the_best_of_repeats_and_an_unsteady_one_is_timed_again_then_doubted(
    monkeypatch, durations, best, unsteady
):
    monkeypatch.setattr(prep, "time", _Clock(durations))
    doubts: list = []
    assert prep._best_ms(lambda: None, torch.device("cpu"), what="x/y step", doubts=doubts) == 1e3 * best
    assert doubts == (["x/y step unsteady (2.5x between its best calls)"] if unsteady else [])


def _fake_measure(figures_of, calls):
    """probe.measure answering ``figures_of(name, how many times it was measured before)``."""

    def fake(model, cand, request, device, best=None, figures=prep.FIGURES, doubts=None, tile_rows=1):
        calls.append(cand.name)
        return figures_of(cand.name, calls.count(cand.name) - 1)

    return fake


def test_a_load_that_slowed_one_candidate_is_passed_over_by_the_second_pass(tmp_path, monkeypatch):
    """bf16/plain measured while the machine was busy (3x its figure): its dtype's best is timed again after
    the others, and the best of both passes is kept: the dtype is the one a quiet machine measures."""
    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("GPT2LAB_PROBE", raising=False)
    monkeypatch.setattr(prep, "estimate_seconds", lambda *a, **k: 1.0)
    calls: list = []

    def busy_first(name, before):
        return Timing(10.0, 10.0) if name.startswith("float32") else Timing(10.0, 24.0 if before == 0 else 8.0)

    monkeypatch.setattr(prep, "measure", _fake_measure(busy_first, calls))
    model, cpu = tiny_gpt(seed=0, vocab_size=97, block_size=16), torch.device("cpu")
    d = prep.decide(model, cpu, InferenceRequest(linear="plain"), facts=ZEN)
    assert d.candidate.dtype == "bfloat16" and d.reason.startswith("the dtype for every workload")
    [entry] = runtime.cached().values()
    assert entry["timings"][d.candidate.name]["step1"] == 8.0 and "not_kept" not in entry


def test_figures_measured_unsteady_are_neither_kept_nor_used(tmp_path, monkeypatch, capsys):
    """A figure whose calls disagree (``_best_ms``' doubt): the figures are neither kept nor used (the device's
    rule decides this run, as it would in any other process), why is gpt2lab env's, and the next run measures
    again; figures kept before are not replaced by doubted ones."""
    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("GPT2LAB_PROBE", raising=False)
    monkeypatch.setattr(prep, "estimate_seconds", lambda *a, **k: 1.0)
    calls: list = []

    def unsteady(step1):
        def fake(model, cand, request, device, best=None, figures=prep.FIGURES, doubts=None, tile_rows=1):
            calls.append(cand.name)
            if cand.name == "bfloat16/plain" and doubts is not None:
                doubts.append("bfloat16/plain step unsteady (2.5x between its best calls)")
            return Timing(10.0, step1)

        return fake

    monkeypatch.setattr(prep, "measure", unsteady(8.0))
    model, cpu = tiny_gpt(seed=0, vocab_size=97, block_size=16), torch.device("cpu")
    request = InferenceRequest(linear="plain")
    d = prep.decide(model, cpu, request, facts=ZEN, command="gpt2lab sample")
    assert d.candidate == prep.choose(request, ZEN).candidate  # the rule's: bf16 on this CPU, plain linears
    assert d.reason.startswith("measured on a busy machine, not kept (gpt2lab env says why), the device's rule")
    assert len(capsys.readouterr().err.splitlines()) == 1  # the notice; why not kept is gpt2lab env's
    [entry] = runtime.cached().values()
    assert cached_timings(entry) is None
    said = entry_lines(entry)[-1]
    assert said.startswith("not kept (reference figures, ") and "the machine was busy): " in said
    assert "bfloat16/plain step unsteady (2.5x between its best calls)" in said
    n = len(calls)
    monkeypatch.setattr(prep, "measure", _fake_measure(lambda name, before: Timing(10.0, 8.0), calls))
    prep.decide(model, cpu, request, facts=ZEN)
    assert len(calls) == 2 * n  # measured again: on a quiet machine now, so kept
    [entry] = runtime.cached().values()
    assert "not_kept" not in entry and not any("not kept" in line for line in entry_lines(entry))

    monkeypatch.setenv("GPT2LAB_PROBE", "fresh")
    monkeypatch.setattr(prep, "measure", unsteady(5.0))
    prep.decide(model, cpu, request, facts=ZEN, command="gpt2lab sample")
    [entry] = runtime.cached().values()
    assert entry["timings"]["bfloat16/plain"]["step1"] == 8.0  # the kept figures are not replaced
    assert entry_lines(entry)[-1].startswith("not kept (reference figures, ")


def test_the_serve_figures_are_the_chosen_dtypes_kernels_at_its_batch_and_kept_beside_the_reference(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("GPT2LAB_PROBE", raising=False)
    calls: list = []
    # reference: fp32/plain 100 + 128 * 8 = 1124 is the cheapest -> float32 for both workloads;
    # serve (8 rows) within it: plain max(1, (100 + 640) / (100 + 192) = 2.53), decode max(1188 / 1124, 1)
    table = {"float32/plain": (100.0, 8.0, 40.0), "float32/decode": (100.0, 8.5, 12.0)}
    table |= {"bfloat16/plain": (100.0, 9.0, 10.0), "bfloat16/decode": (100.0, 9.5, 10.0)}

    def fake(model, cand, request, device, best=None, figures=prep.FIGURES, doubts=None, tile_rows=1):
        what = figures
        calls.append((cand.name, what))
        p, s1, sr = table[cand.name]
        return Timing(p, s1) if "prefill" in what else Timing(step_rows=sr)

    monkeypatch.setattr(prep, "measure", fake)
    model, cpu = tiny_gpt(seed=0, vocab_size=97, block_size=16), torch.device("cpu")
    serve = prep.decide(model, cpu, InferenceRequest(linear="plain", workload="serve", rows=8), facts=ZEN)
    sample = prep.decide(model, cpu, InferenceRequest(linear="plain"), facts=ZEN)
    assert (serve.candidate.name, sample.candidate.name) == ("float32/decode", "float32/plain")
    rows_calls = [n for n, what in calls if what == ("step_rows",)]
    assert sorted(rows_calls) == ["float32/decode", "float32/plain"]  # the chosen dtype's kernels only
    [entry] = json.loads((tmp_path / runtime.PROBE_FILE).read_text())["entries"].values()
    assert entry["rows"]["8"]["timings"] == {"float32/plain": 40.0, "float32/decode": 12.0}
    assert entry["choices"] == {"serve 8 rows": "float32/decode", "sample": "float32/plain"}
    n = len(calls)
    prep.decide(model, cpu, InferenceRequest(linear="plain", workload="serve", rows=8), facts=ZEN)
    assert len(calls) == n  # both read back


def test_serve_rows_measured_unsteady_are_neither_kept_nor_used(tmp_path, monkeypatch):
    """Serve's --max-batch-row figures whose calls disagree: not kept (why: under not_kept, for gpt2lab env),
    nor used (the kernel by the one-row figures, as any process takes it); the next run measures them again."""
    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("GPT2LAB_PROBE", raising=False)
    monkeypatch.setattr(prep, "estimate_seconds", lambda *a, **k: 1.0)
    table = {"float32/plain": (100.0, 8.0, 40.0), "float32/decode": (100.0, 8.5, 12.0)}
    table |= {"bfloat16/plain": (100.0, 9.0, 10.0), "bfloat16/decode": (100.0, 9.5, 10.0)}
    unsteady = [True]

    def fake(model, cand, request, device, best=None, figures=prep.FIGURES, doubts=None, tile_rows=1):
        p, s1, sr = table[cand.name]
        if "step_rows" not in figures:
            return Timing(p, s1)
        if unsteady[0]:
            doubts.append(f"{cand.name} 8-row step unsteady (3.0x between its best calls)")
        return Timing(step_rows=sr)

    monkeypatch.setattr(prep, "measure", fake)
    model, cpu = tiny_gpt(seed=0, vocab_size=97, block_size=16), torch.device("cpu")
    serve = InferenceRequest(linear="plain", workload="serve", rows=8)
    assert prep.decide(model, cpu, serve, facts=ZEN).candidate.name == "float32/plain"  # by the one-row figures
    [entry] = runtime.cached().values()
    assert "rows" not in entry and "float32/plain 8-row step unsteady" in entry["not_kept"]["rows"]["why"][0]
    unsteady[0] = False
    assert prep.decide(model, cpu, serve, facts=ZEN).candidate.name == "float32/decode"  # measured again, kept
    [entry] = runtime.cached().values()
    assert entry["rows"]["8"]["timings"] == {"float32/plain": 40.0, "float32/decode": 12.0} and "not_kept" not in entry


def _sample(d: str, *extra: str) -> list[str]:
    from gpt2lab import cli

    argv = ["sample", "--model", d, "--device", "cpu", "--max-new-tokens", "24", "--no-stop-at-eot", *extra]
    assert cli.main(argv) == 0
    return argv


def test_a_run_whose_steps_are_far_slower_than_its_cached_figure_drops_it_once(
    gpt2_vocab_export, tmp_path, monkeypatch, capsys
):
    """Cached figures no real step can meet (a 1e-6 ms step): `gpt2lab sample` sees its own steps take
    far longer, says so once and drops the entry, and the next run measures again. Figures its steps
    meet (1e6 ms) stay."""
    _, d = gpt2_vocab_export
    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("GPT2LAB_PROBE", raising=False)
    monkeypatch.setattr(prep, "estimate_seconds", lambda *a, **k: 1.0)
    calls: list = []
    fast = lambda name, before: Timing(1e-6, 1e-6) if name == "float32/plain" else Timing(1.0, 1.0)  # noqa: E731
    monkeypatch.setattr(prep, "measure", _fake_measure(fast, calls))
    _sample(d)
    err = capsys.readouterr().err
    assert "gpt2lab sample: dtype float32, plain linears" in err
    dropped = [line for line in err.splitlines() if "those figures are dropped" in line]
    assert len(dropped) == 1 and "measured for float32/plain: those figures are dropped" in dropped[0]
    assert json.loads((tmp_path / runtime.PROBE_FILE).read_text())["entries"] == {}
    n = len(calls)
    slow = lambda name, before: Timing(1e6, 1e6) if name == "float32/plain" else Timing(2e6, 2e6)  # noqa: E731
    monkeypatch.setattr(prep, "measure", _fake_measure(slow, calls))
    _sample(d)
    assert len(calls) > n and "dropped" not in capsys.readouterr().err  # measured again; these hold
    assert len(json.loads((tmp_path / runtime.PROBE_FILE).read_text())["entries"]) == 1


def test_for_inference_auto_takes_the_cached_measured_dtype_and_writes_nothing(tmp_path, monkeypatch):
    """for_inference(dtype="auto") holds what `sample` measured for this model on this machine (either
    way the figures go), the device's rule when nothing is cached or GPT2LAB_PROBE=0."""
    from gpt2lab.inference.choice import rule
    from gpt2lab.inference.form import detect_facts

    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("GPT2LAB_PROBE", raising=False)
    model, cpu = tiny_gpt(seed=7, vocab_size=97, block_size=32), torch.device("cpu")
    facts = detect_facts(cpu)
    if len({c.dtype for c in candidates(InferenceRequest(), facts)}) < 2:
        pytest.skip("one dtype on this device")

    def held(m):
        return {
            (mod.kernel, str(mod.dtype).removeprefix("torch.")) for mod in m.modules() if isinstance(mod, DecodeLinear)
        }

    by_rule = rule(InferenceRequest(), facts).candidate
    assert held(for_inference(model, dtype="auto")) == {(by_rule.kernel, by_rule.dtype)}  # nothing cached
    for winner in ("float32", "bfloat16"):
        calls: list = []
        pick = lambda name, before: Timing(10.0, 1.0 if name.startswith(winner + "/") else 3.0)  # noqa: E731
        monkeypatch.setattr(prep, "measure", _fake_measure(pick, calls))
        monkeypatch.setenv("GPT2LAB_PROBE", "fresh")
        measured = prep.decide(model, cpu, InferenceRequest()).candidate
        monkeypatch.delenv("GPT2LAB_PROBE")
        assert measured.dtype == winner
        stamp = (tmp_path / runtime.PROBE_FILE).stat().st_mtime_ns
        assert held(for_inference(model, dtype="auto")) == {(measured.kernel, winner)}
        assert (tmp_path / runtime.PROBE_FILE).stat().st_mtime_ns == stamp  # read, not written
    monkeypatch.setenv("GPT2LAB_PROBE", "0")
    assert held(for_inference(model, dtype="auto")) == {(by_rule.kernel, by_rule.dtype)}


@pytest.mark.parametrize("workload", ["sample", "serve", "score"])
def test_the_dtype_is_the_least_behind_at_its_worse_of_one_row_and_a_batch(workload):
    """Figures as measured on a 2-core AVX2 EPYC (no native bf16): bf16 weights read half the bytes, so
    its one-row reference request is 1.19x cheaper, but its 16-row steps are emulated bf16 matmuls, 4x
    fp32's. Worse cases: fp32 1.19x (one row), bf16 ~3.4x (the batch): fp32 for every workload. Where bf16
    leads at both (a CPU with native bf16), bf16."""
    from gpt2lab.inference.choice import BATCH_ROWS, REQUEST_TOKENS, choose, reference_cost

    emulated = {
        "float32/packed": Timing(308.0, 53.5, None, 74.9),
        "float32/decode": Timing(290.0, 55.0),
        "bfloat16/plain": Timing(1292.6, 36.94, None, 300.0),
    }
    one = {n: reference_cost(t) for n, t in emulated.items()}
    assert one["bfloat16/plain"] < one["float32/packed"] / 1.15  # bf16 leads at one row
    bf16, fp32 = (emulated[n] for n in ("bfloat16/plain", "float32/packed"))
    bf16_batch = reference_cost(bf16, bf16.step_batch, BATCH_ROWS) / reference_cost(fp32, fp32.step_batch, BATCH_ROWS)
    assert bf16_batch == pytest.approx((1292.6 + REQUEST_TOKENS * 300.0 / BATCH_ROWS) / (308 + 128 * 74.9 / 16))
    assert bf16_batch > 3  # and falls far behind in a batch
    request = InferenceRequest(workload=workload, rows=BATCH_ROWS)
    d = choose(request, dataclasses.replace(AVX2, timings=emulated))
    assert (
        d.candidate.dtype == "float32"
        and "the least behind (a 128-token prefill and 128 steps at one row / in a 16-row batch)" in d.reason
    )
    native = {**emulated, "bfloat16/plain": Timing(200.0, 20.0, None, 40.0)}
    assert choose(request, dataclasses.replace(AVX2, timings=native)).candidate.dtype == "bfloat16"
    one_row_only = {n: dataclasses.replace(t, step_batch=None) for n, t in emulated.items()}
    assert choose(request, dataclasses.replace(AVX2, timings=one_row_only)).candidate.dtype == "bfloat16"
