"""`gpt2lab bench sample` and `bench serve` end to end on a tiny shape, in process: the peers run on
the very weights gpt2lab runs and give the same greedy tokens in fp32 (transformers and CTranslate2
are the independent references); the library's generate() and `sample` agree token for token."""

from __future__ import annotations

import json

import pytest

from gpt2lab import cli
from gpt2lab.benchmarks import peers
from gpt2lab.inference import probe
from gpt2lab.inference.choice import Timing

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "64", "--threads", "1"]


def _json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_bench_sample_times_every_way_beside_its_peers_on_the_same_weights(capsys, tmp_path, monkeypatch):
    """The probe's figures are faked (steady, packed the fastest): real ones taken on a busy machine are not
    kept, and the output would hold none."""
    pytest.importorskip("ctranslate2", reason="the CTranslate2 peer needs pip install ctranslate2")
    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("GPT2LAB_PROBE", raising=False)
    fake = lambda model, cand, *a, **k: Timing(5.0, 1.0 if cand.kernel == "packed" else 2.0)  # noqa: E731
    monkeypatch.setattr(probe, "measure", fake)
    assert (
        cli.main(
            [
                "bench",
                "sample",
                *TINY,
                "--new-tokens",
                "24",
                "--repeats",
                "1",
                "--dtype",
                "float32",
                "--peer",
                "transformers,ctranslate2",
            ]
        )
        == 0
    )
    r = _json(capsys.readouterr().out)
    assert r["asked"] == {"dtype": "float32", "quantize": "none", "cpu_linear": "auto"}
    assert r["inference"]["dtype"] == "float32" and r["inference"]["kernel"] == "packed"
    assert set(r["inference"]["timings_ms"]) == {"float32/plain", "float32/decode", "float32/packed"}
    assert r["inference"]["timings_ms"]["float32/packed"]["step1"] == 1.0
    assert all(v > 0 for v in r["tok_per_s"].values())
    assert r["held_pages"].startswith("4 KiB pages (")  # fp32 weights as stored: the source model's own
    assert r["tokens_agree_generate_vs_sample"] and r["tokens_agree_cache_vs_no_cache"]
    assert r["first_mismatch_vs_transformers"] is None
    assert r["first_mismatch_vs_ctranslate2_float32"] is None
    assert r["ctranslate2_tok_per_s"]["float32"] > 0 and r["ctranslate2_tok_per_s"]["int8"] > 0
    assert r["vs_ctranslate2"]["float32"] == pytest.approx(
        r["tok_per_s"]["sample"] / r["ctranslate2_tok_per_s"]["float32"]
    )


def test_bench_serve_defaults_are_serves_and_the_peer_runs_a_batch_per_stream_count(capsys, tmp_path, monkeypatch):
    pytest.importorskip("ctranslate2", reason="the CTranslate2 peer needs pip install ctranslate2")
    pytest.importorskip("uvicorn", reason="gpt2lab serve needs the serve extra")
    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path))
    monkeypatch.setenv("GPT2LAB_PROBE", "0")  # the device's rule decides: nothing measured
    assert (
        cli.main(
            [
                "bench",
                "serve",
                *TINY,
                "--device",
                "cpu",
                "--new-tokens",
                "8",
                "--streams",
                "1,2",
                "--seconds",
                "0.5",
                "--max-batch",
                "2",
                "--peer",
                "ctranslate2",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    r = _json(captured.out)
    assert r["asked"] == {"dtype": "auto", "quantize": "none", "cpu_linear": "auto"}  # serve's defaults
    assert r["inference"]["workload"] == "serve" and r["inference"]["rows"] == 2
    assert "not measured" in r["inference"]["reason"] and "gpt2lab serve: bench: dtype" in captured.err
    assert [x["streams"] for x in r["load"]] == [1, 2] and all(x["errors"] == 0 and x["tokens"] > 0 for x in r["load"])
    assert [c["rows"] for c in r["ctranslate2"]] == [1, 2]
    assert all(c["aggregate_tok_per_s"]["float32"] > 0 for c in r["ctranslate2"])


@pytest.mark.parametrize(
    "argv, says",
    [
        (["ladder", "--rungs", "nope"], "--rungs: unknown nope; choose from"),
        (["hellaswag", "--repeats", "0"], "--repeats must be at least 1, got 0"),
        (["memory", "--size", "999M", "--plan", "80"], "--size 999M: unknown GPT-2 size '999M'; choose one of"),
        (["lora", "--size", "gpt5"], "unknown GPT-2 size 'gpt5'; choose one of"),
    ],
)
def test_a_bench_flag_that_cannot_work_is_one_line_and_exit_2(argv, says, capsys):
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


def test_a_peer_that_is_not_one_is_one_line(capsys):
    assert cli.main(["bench", "sample", *TINY, "--peer", "vllm"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("--peer vllm: choose from transformers, ctranslate2 or none (comma-separated)")
    )


FAKE_CONVERTER = """
import sys
hf_dir = sys.argv[1]
outfile, kind = sys.argv[sys.argv.index("--outfile") + 1], sys.argv[sys.argv.index("--outtype") + 1]
assert open(hf_dir + "/config.json").read()  # handed gpt2lab's export
if kind == "bf16":
    sys.exit("NotImplementedError: no bf16 here")
open(outfile, "w").write(kind)
"""

FAKE_BENCH = """#!{python}
import json, sys
args = sys.argv[1:]
open({log!r}, "a").write(" ".join(args) + "\\n")
kind = open(args[args.index("-m") + 1]).read()
calls = sum(args[args.index("-m") + 1] in line for line in open({log!r}))  # this one included
runs = int(args[args.index("-r") + 1])
samples = {{"f32": [10.0, 12.5, 11.0], "f16": [7.0, 6.0], "q8_0": [19.0, 20.0]}}[kind][calls - 1 : calls - 1 + runs]
print(json.dumps([{{"n_gen": int(args[args.index("-n") + 1]), "samples_ts": samples}}]))
"""


def test_llama_cpp_peer_converts_the_export_and_reads_llama_benchs_json(capsys, tmp_path, monkeypatch):
    """The plumbing around llama.cpp, with stand-ins for its converter and llama-bench: every type is
    converted from gpt2lab's export, timed with the run's shape and threads once in each of gpt2lab's
    rounds, the best round kept, and a type that fails is named with its error, not dropped."""
    import sys

    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path))
    tree = tmp_path / "llama.cpp"
    (tree / "build" / "bin").mkdir(parents=True)
    (tree / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER)
    bench, log = tree / "build" / "bin" / "llama-bench", tmp_path / "calls.txt"
    bench.write_text(FAKE_BENCH.format(python=sys.executable, log=str(log)))
    bench.chmod(0o755)
    argv = ["bench", "sample", *TINY, "--new-tokens", "24", "--prompt-tokens", "16", "--repeats", "2"]
    assert cli.main([*argv, "--dtype", "float32", "--peer", "none", "--ways", "sample", "--llama-cpp", str(bench)]) == 0
    r = _json(capsys.readouterr().out)
    got = r["llama_cpp_tok_per_s"]
    assert (got["f32"], got["f16"], got["q8_0"]) == (12.5, 7.0, 20.0)
    assert [x["f16"] for x in r["llama_cpp_rounds"]] == [7.0, 6.0]  # one a round, as gpt2lab's seconds
    assert len(r["seconds"]["sample"]) == 2
    assert got["bf16"].startswith("not run: conversion failed: NotImplementedError: no bf16 here")
    assert (
        r["vs_llama_cpp"]["f32"] == pytest.approx(r["tok_per_s"]["sample"] / 12.5) and "bf16" not in r["vs_llama_cpp"]
    )
    # decoding alone (23 steps after the first new token) is faster than the whole run, prompt included
    decoding = r["decode_tok_per_s"]["sample"]
    assert decoding > r["tok_per_s"]["sample"] * 23 / 24
    assert r["decoding_vs_llama_cpp"]["q8_0"] == pytest.approx(decoding / 20.0)
    calls = log.read_text().splitlines()
    assert len(calls) == 2 * 3  # two rounds of the three types that converted
    for call in calls:
        assert " -p 0 -n 24 -d 16 -r 1 -t 1 -o json" in call


def test_llama_cpp_without_its_converter_is_one_line(capsys, tmp_path):
    bench = tmp_path / "llama-bench"
    bench.write_text("#!/bin/sh\n")
    bench.chmod(0o755)
    assert cli.main(["bench", "sample", *TINY, "--peer", "none", "--llama-cpp", str(bench)]) == 2
    assert "no convert_hf_to_gguf.py in the llama.cpp tree above it" in capsys.readouterr().err


def test_llama_cpp_rounds_keep_each_types_best_and_an_error_only_where_no_round_ran():
    rounds = [
        {"f32": 10.0, "bf16": "not run: llama-bench exit -9: killed", "q8_0": "not run: conversion failed"},
        {"f32": 9.0, "bf16": 31.5, "q8_0": "not run: conversion failed"},
        {"f32": 11.5, "bf16": 30.0, "q8_0": "not run: conversion failed"},
    ]
    assert peers.best_rounds(rounds) == {"f32": 11.5, "bf16": 31.5, "q8_0": "not run: conversion failed"}
