"""`gpt2lab serve`'s refusals before it serves, each one line and its exit code: a model that is not
there, a bad limit, a model id given twice, a port in use or out of range, a precision the device
cannot run (the signals are in e2e/test_serve_cli.py)."""

from __future__ import annotations

import pytest

from gpt2lab import cli


def test_serve_bad_model_is_one_line(tmp_path, capsys):
    missing = str(tmp_path / "missing")
    assert cli.main(["serve", "--model", missing, "--device", "cpu", "--port", "0"]) == 1
    assert capsys.readouterr().err.strip().startswith(f"gpt2lab serve: --model {missing}: no such directory")
    assert cli.main(["serve", "--model", missing, "--max-queue", "0", "--port", "0"]) == 2  # a UsageError
    assert capsys.readouterr().err.strip().endswith("--max-queue 0: must be at least 1")
    # an id given twice: a UsageError naming it, before any model is looked for
    assert cli.main(["serve", "--model", f"a={missing}", "--model", f"a={tmp_path}", "--port", "0"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"gpt2lab serve: --model a={tmp_path}: the id 'a' is given twice; name them apart with NAME=MODEL"
    ]


def test_every_model_source_is_checked_before_the_first_is_loaded(gpt2_vocab_export, tmp_path, capsys, monkeypatch):
    """`--model a=GOOD --model b=MISSING`: refused in one line naming the second, the first never loaded nor
    measured."""
    from gpt2lab.weights import load

    loaded = []
    monkeypatch.setattr(load, "load_model", lambda *a, **k: loaded.append(a))
    missing = str(tmp_path / "missing")
    _, good = gpt2_vocab_export
    assert cli.main(["serve", "--model", f"a={good}", "--model", f"b={missing}", "--port", "0"]) == 1
    [said] = capsys.readouterr().err.splitlines()
    assert said.startswith(f"gpt2lab serve: --model {missing}: no such directory") and loaded == []


@pytest.mark.parametrize(
    "flags,said",
    [
        (["--header-timeout", "0"], "gpt2lab serve: --header-timeout 0.0: must be positive"),
        (["--max-connections", "0"], "gpt2lab serve: --max-connections 0: must be at least 1"),
    ],
)
def test_bad_connection_flags_are_one_line_and_exit_2(flags, said, capsys):
    assert cli.main(["serve", "--model", "no/such/dir", "--port", "0", *flags]) == 2
    assert capsys.readouterr().err.splitlines() == [said]


def test_a_cap_past_the_open_file_limit_is_one_line_and_exit_2(capsys):
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        pytest.skip("no open-file limit to pass")
    assert cli.main(["serve", "--model", "no/such/dir", "--port", "0", "--max-connections", str(soft)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"gpt2lab serve: --max-connections {soft}: this process may open {soft} files (ulimit -n)")


def test_allowed_hosts_takes_names_not_urls(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--model", "m", "--allowed-hosts", "example.org:8000"])
    assert e.value.code == 2 and "without ports or schemes" in capsys.readouterr().err


def test_port_in_use_is_one_line_and_exit_2(gpt2_vocab_export, capsys):
    import socket

    _, d = gpt2_vocab_export
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        assert cli.main(["serve", "--model", d, "--device", "cpu", "--port", str(port)]) == 2
    finally:
        holder.close()
    assert capsys.readouterr().err.splitlines() == [
        f"gpt2lab serve: --port {port} on 127.0.0.1 is in use (another server?); stop it or pick another --port"
    ]


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_port_out_of_range_is_one_line_and_exit_2(gpt2_vocab_export, capsys, port):
    _, d = gpt2_vocab_export
    assert cli.main(["serve", "--model", d, "--device", "cpu", "--port", port]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"gpt2lab serve: --port {port}: must be 0 to 65535 (0 lets the system pick a free one)"
    ]


def test_a_precision_the_device_cannot_run_is_one_line_and_exit_2_before_loading(capsys):
    # no such model: the flag is refused first, so the model is never looked for
    assert cli.main(["serve", "--model", "no/such/dir", "--device", "cpu", "--port", "0", "--dtype", "float16"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("gpt2lab serve: --dtype float16 needs a GPU")
