"""What a newcomer meets at the command line: a prompt past the model's context refused as the server
refuses it, the first sample's probe announced before it runs and its choice on a line of its own
before the text, every default in `sample --help` and `serve --help`, a bad model source named once."""

from __future__ import annotations

import io
import re
import sys

import pytest

from gpt2lab import cli
from gpt2lab.data.tokenizer import gpt2_tokenizer


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# -- a prompt longer than the context ------------------------------------------------------------
def _sample(model: str, prompt: str, new: int) -> list[str]:
    return [
        "sample",
        "--model",
        model,
        "--device",
        "cpu",
        "--prompt",
        prompt,
        "--max-new-tokens",
        str(new),
        "--seed",
        "1",
    ]


def test_sample_refuses_a_prompt_and_new_tokens_past_the_context_as_the_server_does(
    gpt2_vocab_export, capsys, monkeypatch
):
    monkeypatch.setenv("GPT2LAB_PROBE", "0")
    model, d = gpt2_vocab_export  # block_size 128
    long_prompt = " one" * 150
    n = len(gpt2_tokenizer().encode(long_prompt))
    assert n == 150
    assert cli.main(_sample(d, long_prompt, 10)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing sampled, not even the prompt
    assert _one_line(captured.err) == (
        "gpt2lab sample: --prompt is 150 tokens and --max-new-tokens 10: 160 tokens, "
        "more than this model's context of 128 tokens; shorten the prompt to under "
        "128 tokens"
    )
    short = " one" * 100  # 100 tokens: 28 new ones fit exactly, 29 do not
    assert cli.main(_sample(d, short, 29)) == 2
    assert _one_line(capsys.readouterr().err).endswith(
        "129 tokens, more than this model's context of 128 tokens; lower --max-new-tokens to 28 or shorten the prompt"
    )
    assert cli.main(_sample(d, short, 28)) == 0
    assert capsys.readouterr().out.startswith("--- sample 1/1\n" + short)


def test_the_server_refuses_by_the_same_rule(monkeypatch):
    from gpt2lab.inference import completion
    from gpt2lab.serve import completions

    seen = []

    def rule(prompt_tokens, max_new_tokens, context):
        seen.append((prompt_tokens, max_new_tokens, context))
        return False

    monkeypatch.setattr(completions, "fits_context", rule)

    class Worker:
        block_size = 128

        class limits:
            max_tokens = 1024

    with pytest.raises(completions.APIError, match="maximum context length is 128"):
        completions._check_length([[1] * 5, [1] * 7], 3, Worker(), default=False, what="prompt")
    assert seen == [(7, 3, 128)]  # the longest prompt, through the shared rule
    assert completion.fits_context(100, 28, 128) and not completion.fits_context(100, 29, 128)


def test_a_model_with_nan_weights_is_named_in_one_warning_as_it_is_loaded(tmp_path, capsys, monkeypatch):
    """Its text is noise ("????"): sample says so once, naming the model and the first bad tensor."""
    import torch
    from conftest import tiny_gpt

    from gpt2lab.weights import export

    monkeypatch.setenv("GPT2LAB_PROBE", "0")
    model = tiny_gpt(seed=3, vocab_size=50257, block_size=32)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] = float("nan")
    d = str(tmp_path / "nan")
    export.save_pretrained(model, d)
    assert cli.main(_sample(d, "Hello", 3)) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warned == [
        f"gpt2lab sample: warning: {d} holds NaN or infinite weights (1 of its tensors, the first "
        "transformer.h.1.mlp.c_fc.weight): what it writes means nothing; train it again or load another checkpoint"
    ]


# -- the first sample on a new machine ------------------------------------------------------------
def test_the_probe_is_announced_before_it_runs_and_its_choice_precedes_the_text(
    gpt2_vocab_export, tmp_path, monkeypatch
):
    from gpt2lab.inference import probe
    from gpt2lab.inference.choice import Timing

    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path))  # a new machine: nothing measured yet
    monkeypatch.delenv("GPT2LAB_PROBE", raising=False)
    # steady figures no run is far slower than (else its Watch would say so: another line)
    monkeypatch.setattr(probe, "measure", lambda *a, **k: Timing(1e3, 1e3))
    _, d = gpt2_vocab_export
    both = io.StringIO()  # stdout and stderr as one terminal shows them, in order
    monkeypatch.setattr(sys, "stdout", both)
    monkeypatch.setattr(sys, "stderr", both)
    assert cli.main(_sample(d, "Hello", 5)) == 0
    lines = both.getvalue().splitlines()
    assert lines[0].startswith("gpt2lab sample: measuring ") and re.search(
        r"(about \d+ s|under a second), once per machine", lines[0]
    ), lines
    assert lines[1].startswith("gpt2lab sample: dtype ") and len(lines[1]) < 160, lines  # one short line
    assert lines[2] == "--- sample 1/1" and lines[3].startswith("Hello") and len(lines) == 4, lines
    both.truncate(0)
    both.seek(0)
    assert cli.main(_sample(d, "Hello", 5)) == 0  # measured once: the second run only says its choice
    lines = both.getvalue().splitlines()
    assert lines[0].startswith("gpt2lab sample: dtype ") and lines[1] == "--- sample 1/1" and len(lines) == 3, lines


def test_the_choice_line_says_that_threads_sleep_while_they_wait_on_a_busy_machine(monkeypatch, capsys):
    """Where the machine was busy as the command started (system/runtime.py's choose_wait), the one line
    that announces the inference choice says so, and the choice's record holds it."""
    from gpt2lab.inference import probe
    from gpt2lab.inference.choice import InferenceRequest, choose
    from gpt2lab.system import runtime
    from gpt2lab.system.runtime import Facts

    decision = choose(InferenceRequest(), Facts("cpu"))
    busy = "; threads sleep while they wait: 1 core busy with other work, 2 of ours on 2 cores"
    for load, said in ((runtime.Load(2, 2, 0), ""), (runtime.Load(2, 2, 1), busy)):
        monkeypatch.setattr(runtime, "WAIT", runtime.choose_wait(load))
        probe.announce(decision, "gpt2lab sample")
        assert capsys.readouterr().err == f"gpt2lab sample: {decision.summary()}{said}\n"
        assert decision.record()["threads_wait"] == runtime.WAIT.reason


# -- --help shows the defaults --------------------------------------------------------------------
@pytest.mark.parametrize(
    "command, defaults",
    [
        (
            "sample",
            [
                "--max-new-tokens",
                "(default: 100)",
                "--temperature",
                "(default: 1.0)",
                "--top-k",
                "(default: 50)",
                "--seed",
                "(default: 42)",
                "--top-p",
                "(default: 1.0)",
                "--dtype",
                "(default: auto)",
            ],
        ),
        (
            "serve",
            [
                "--port",
                "(default: 8000)",
                "--host",
                "(default: 127.0.0.1)",
                "--max-batch",
                "(default: 16)",
                "--max-tokens",
                "(default: 1024)",
                "--timeout",
                "(default: 600.0)",
                "--dtype",
                "(default: auto)",
            ],
        ),
    ],
)
def test_help_shows_each_default_once(command, defaults, capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    entries = {}  # flag -> its help, the wrapped lines joined
    for line in text.split("options:")[1].strip("\n").splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            entries[flag] = " ".join(line.split()[1:])
        else:
            entries[flag] += " " + line.strip()
    for flag, default in zip(defaults[::2], defaults[1::2]):
        assert entries[flag].count("default") == 1 and entries[flag].endswith(default), entries[flag]
    assert "(default: None)" not in text


# -- a bad model source is named once -------------------------------------------------------------
@pytest.mark.parametrize(
    "argv",
    [
        ["sample", "--model", "{m}", "--device", "cpu"],
        ["export", "{m}", "{out}"],
        ["eval", "loss", "--model", "{m}", "--data", "{out}", "--device", "cpu"],
    ],
)
def test_a_directory_of_junk_is_named_once(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    junk = tmp_path / "junk2"
    junk.mkdir()
    (junk / "notes.txt").write_text("not a model")
    assert cli.main([a.format(m="junk2", out=str(tmp_path / "out")) for a in argv]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.count("junk2") == 1 and "junk2: neither a checkpoint" in line, line


def test_the_python_api_and_init_from_name_a_junk_source_once(tmp_path, capsys, monkeypatch, tiny_data):
    import gpt2lab
    from gpt2lab.weights.load import WeightsError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "junk2").mkdir()
    with pytest.raises(WeightsError) as e:
        gpt2lab.from_pretrained("junk2")
    assert str(e.value).count("junk2") == 1, str(e.value)
    # a checkpoint directory missing its state.pt
    (tmp_path / "junk3").mkdir()
    (tmp_path / "junk3" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "junk3" / "config.json").write_text("{}")
    assert (
        cli.main(
            [
                "train",
                "--preset",
                "shakespeare-cpu",
                "--init-from",
                "junk3",
                "--data",
                tiny_data,
                "--out",
                str(tmp_path / "run"),
                "--dry-run",
            ]
        )
        == 2
    )
    line = _one_line(capsys.readouterr().err)
    assert line.count("junk3") == 1 and "--init-from junk3: it is an incomplete checkpoint" in line, line


def test_make_says_what_its_first_install_does_before_pip_runs_quietly():
    import shutil
    import subprocess

    from conftest import ROOT

    if not shutil.which("make"):
        pytest.skip("no make on this machine")
    lines = subprocess.run(
        ["make", "-n", "-B", "install"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    say = next(i for i, line in enumerate(lines) if line.startswith("echo "))
    pip = next(i for i, line in enumerate(lines) if "pip install -q" in line)
    assert say < pip and "a few minutes" in lines[say], lines
