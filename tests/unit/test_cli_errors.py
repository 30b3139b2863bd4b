"""A mistyped flag or choice: the subcommand's own usage and one error line with a suggestion, exit 2."""

import argparse

import pytest

from gpt2lab import cli


def _fails(argv, capsys) -> list[str]:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def test_a_mistyped_flag_names_the_flag_it_meant_under_the_subcommands_usage(capsys):
    usage, line = _fails(["train", "--preset", "shakespeare-cpu", "--max-step", "5"], capsys)
    assert usage.startswith("usage: gpt2lab train ") and "COMMAND" not in usage  # not the top-level usage
    assert line == "gpt2lab train: error: unrecognized arguments: --max-step 5; did you mean --max-steps?"
    usage, line = _fails(["report", "runs/x", "--ot", "r.html"], capsys)
    assert usage == "usage: gpt2lab report [-h] [--out OUT] RUN_DIR"  # a short usage is shown whole
    assert line.endswith("; did you mean --out?")


def test_two_mistyped_flags_each_get_theirs_and_a_word_with_nothing_near_gets_none(capsys):
    _, line = _fails(["report", "runs/x", "--ot", "r.html", "--debgu-x"], capsys)
    assert line.endswith("did you mean --out for --ot?")  # --debgu-x is near nothing report takes
    _, line = _fails(["report", "runs/x", "extra"], capsys)
    assert line == "gpt2lab report: error: unrecognized arguments: extra"


def test_a_mistyped_command_or_choice_gets_the_nearest_name(capsys):
    _, line = _fails(["trian"], capsys)
    assert line.endswith("; did you mean train?")
    _, line = _fails(["train", "--preset", "shakespeare-cpu", "--dtype", "flaot32"], capsys)
    assert "argument --dtype: invalid choice: 'flaot32'" in line and line.endswith("did you mean float32?")


def test_a_suggestion_argparse_made_itself_is_not_made_twice():
    p = argparse.ArgumentParser()
    said = "argument COMMAND: invalid choice: 'trian', maybe you meant 'train'? (choose from train, sample)"
    assert cli.suggest(said, p) == said  # Python 3.14's suggest_on_error wording
    newer = "argument COMMAND: invalid choice: 'trian' (choose from train, sample)"  # 3.12's unquoted list
    assert cli.suggest(newer, p) == newer + "; did you mean train?"
