"""The ``gpt2lab`` console script: one subcommand per job, each a thin wrapper.

Each subcommand lives in ``gpt2lab/commands/<name>.py`` with ``add_parser(subparsers)``,
which registers its flags and sets ``func(args) -> int`` as the parser default. Library
code raises typed errors (gpt2lab.system.errors); ``main`` prints each as one line and exits
with its documented code.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import importlib
import re
import sys
import warnings
from typing import Optional, Sequence

from gpt2lab import __version__
from gpt2lab.system import env, errors, runtime

COMMANDS = ["tokenizer", "prepare", "train", "sample", "eval", "export", "plot", "compare", "bench", "demo"]
COMMANDS += ["env", "serve", "report"]
_PATH_ERRNOS = (errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR)


class Parser(argparse.ArgumentParser):
    """Every gpt2lab parser (subcommands inherit it): no prefix guessing, negative numbers as values.

    ``--max-step 5`` must not quietly mean ``--max-steps 5``; ``--max-lr -1e-3`` must reach
    the config's validation as a value (argparse only knows ``-1`` and ``-.5`` as numbers).
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-inf$")

    def error(self, message: str):
        """This parser's usage (a subcommand's own; a long one shortened to a pointer at --help), then
        one line: the error, with "did you mean" for a mistyped flag or choice. Exit 2."""
        usage = self.format_usage().strip()
        if "\n" in usage or len(usage) > 120:
            usage = f"usage: {self.prog} [options] ({self.prog} --help lists them)"
        self.exit(2, f"{usage}\n{self.prog}: error: {suggest(message, self)}\n")


def suggest(message: str, parser: argparse.ArgumentParser) -> str:
    """``message`` with the nearest known name (difflib) for each unknown flag of ``parser`` it names
    ("unrecognized arguments: ...") or for an invalid choice, unless argparse suggested one already."""
    unknown = re.match(r"unrecognized arguments: (.*)", message)
    if unknown:
        known = [s for a in parser._actions for s in a.option_strings]  # argparse keeps no public list
        flags = [w.split("=", 1)[0] for w in unknown.group(1).split() if w.startswith("-")]
        hints = [(f, near[0]) for f in flags for near in [difflib.get_close_matches(f, known, n=1)] if near]
        if len(flags) == 1 and hints:
            return f"{message}; did you mean {hints[0][1]}?"
        return message + (f"; did you mean {', '.join(f'{near} for {f}' for f, near in hints)}?" if hints else "")
    choice = re.match(r"argument (.*): invalid choice: '([^']*)'.*\(choose from (.*)\)$", message, re.S)
    if choice and "maybe you meant" not in message:
        names = re.findall(r"'([^']*)'", choice.group(3)) or [c.strip() for c in choice.group(3).split(",")]
        near = difflib.get_close_matches(choice.group(2), names, n=1)
        if near:
            return f"{message}; did you mean {near[0]}?"
    return message


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The CLI's parser; with ``command``, its subcommand's flags alone (the others' modules are not
    imported: ``gpt2lab prepare`` does not pay for the torch that ``bench``'s flags import)."""
    codes = "\n".join(f"  {code:3d}  {what}" for code, what in errors.EXIT_CODES.items())
    parser = Parser(
        prog="gpt2lab",
        description="Reproduce and train GPT-2-class language models.",
        epilog=f"exit codes:\n{codes}\nErrors print one line; --debug (or GPT2LAB_DEBUG=1) shows the traceback.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gpt2lab {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in [command] if command else COMMANDS:
        importlib.import_module(f"gpt2lab.commands.{name}").add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    runtime.set_wait_policy()  # before torch is imported: OpenMP reads it then
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or env.debug()
    argv = [a for a in argv if a != "--debug"]  # accepted after the subcommand too
    command = next((a for a in argv if a in COMMANDS), None)
    prefix = f"gpt2lab {command}" if command else "gpt2lab"
    shown = warnings.formatwarning  # warnings as one line: "gpt2lab CMD: warning: ...", not file:line: UserWarning
    warnings.formatwarning = lambda message, category, *rest, **kw: f"{prefix}: warning: {message}\n"
    try:
        parser = build_parser(command)
        args, extra = parser.parse_known_args(argv)
        if extra:  # flags its subcommand does not know are that subcommand's error (its usage, a suggestion)
            sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        args.argv = argv  # the words as typed: a command's advice repeats them (train's --resume auto)
        prefix = " ".join(
            ["gpt2lab", *(str(getattr(args, k)) for k in ("command", "task", "action") if hasattr(args, k))]
        )
        return int(args.func(args) or 0)
    except (KeyboardInterrupt, errors.GPT2LabError, OSError) as e:
        if debug:
            raise
        code, line = _one_line(e)
        print(f"{prefix}: {line}", file=sys.stderr)
        return code
    finally:
        warnings.formatwarning = shown


def _one_line(e: BaseException) -> tuple[int, str]:
    """The exit code and the one line of an interruption, a gpt2lab error, or a file the command was pointed
    at (or a full disk)."""
    if isinstance(e, KeyboardInterrupt):
        return errors.EXIT_INTERRUPTED, "interrupted"
    if isinstance(e, errors.GPT2LabError):
        return e.exit_code, str(e)
    if errors.is_disk_full(e):
        return errors.EXIT_DISK_FULL, str(errors.disk_full(e.filename or "a file"))
    hint = "; check the path and its permissions" if e.errno in _PATH_ERRNOS else ""
    return errors.EXIT_ERROR, f"{f'{e.filename}: ' if e.filename else ''}{e.strerror or e}{hint}"


if __name__ == "__main__":
    sys.exit(main())
