"""Poor output cases: export's file modes under the user's umask, report/plot on a
metrics.jsonl of garbage bytes, and warnings printed as one `gpt2lab CMD: warning: ...` line."""

from __future__ import annotations

import os
import stat

import pytest

from gpt2lab import cli


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_export_writes_every_file_with_the_umasks_mode(gpt2_vocab_export, tmp_path, umask):
    _, d = gpt2_vocab_export
    old = os.umask(umask)
    try:
        assert cli.main(["export", d, str(tmp_path / "out")]) == 0
    finally:
        os.umask(old)
    modes = {name: stat.S_IMODE(os.stat(tmp_path / "out" / name).st_mode) for name in os.listdir(tmp_path / "out")}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, {
        k: oct(v) for k, v in modes.items()
    }
    assert stat.S_IMODE(os.stat(tmp_path / "out").st_mode) == 0o777 & ~umask


@pytest.mark.parametrize("command", ["report", "plot"])
def test_report_and_plot_on_garbage_metrics_name_the_file(tmp_path, capsys, command):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(b'{"step": 0, "train_loss": 1.0}\n' + bytes(range(128, 256)) * 8)
    argv = [command, str(run)] + (["--out", str(tmp_path / "p.png")] if command == "plot" else [])
    try:
        code, err = cli.main(argv), capsys.readouterr().err
    except SystemExit as e:
        code, err = 1, str(e.code)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert f"{run / 'metrics.jsonl'}:2: not UTF-8 text" in lines[0], err
    assert not (tmp_path / "p.png").exists()


def test_the_warning_format_is_restored_after_main(tmp_path, capsys):
    import warnings

    before = warnings.formatwarning
    try:
        cli.main(["report", str(tmp_path / "missing")])
    except SystemExit:
        pass
    assert warnings.formatwarning is before


def _metrics_run(path, name: str):
    run = path / name
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "".join(
            f'{{"step": {s}, "train_loss": {3.0 - s / 10}, "val_loss": {3.1 - s / 10}, "tokens": {1000 * s}}}\n'
            for s in range(5)
        )
    )
    return str(run)


@pytest.mark.parametrize("command", ["plot", "compare"])
def test_plot_and_compare_never_overwrite_a_file_they_did_not_write(tmp_path, capsys, command):
    """--out over someone's file (a foreign PNG, any file, a folder) is one line, exit 2, the file
    untouched; over a PNG gpt2lab wrote it replaces it (the Software text chunk says which)."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [_metrics_run(tmp_path, "a"), _metrics_run(tmp_path, "b")][: 1 if command == "plot" else 2]
    theirs = tmp_path / "theirs.png"
    fig = plt.figure()
    fig.savefig(theirs)  # matplotlib's own PNG: Software "Matplotlib version ..."
    plt.close(fig)
    other = tmp_path / "notes.txt"
    other.write_text("keep me")
    folder = tmp_path / "folder.png"
    folder.mkdir()
    in_run = tmp_path / "a" / "notes.json"  # a run directory's own files are not plot.png
    in_run.write_text("{}")
    (tmp_path / "a" / "run_info.json").write_text('{"world_size": 1, "torch": "2.13"}')
    for target in (theirs, other, folder, in_run):
        before = target.read_bytes() if target.is_file() else None
        assert cli.main([command, *runs, "--out", str(target)]) == 2
        said = "is a directory" if target == folder else "is a file gpt2lab did not write"
        assert capsys.readouterr().err.strip() == (
            f"gpt2lab {command}: --out {target}: {said}; nothing was written there; pick another path"
        )
        assert (target.read_bytes() if target.is_file() else None) == before
    ours = tmp_path / "ours.png"
    for _ in range(2):  # the second run replaces the first's PNG
        assert cli.main([command, *runs, "--out", str(ours)]) == 0
        assert b"Software\x00gpt2lab" in ours.read_bytes()[:4096]
    capsys.readouterr()
