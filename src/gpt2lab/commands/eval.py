"""gpt2lab eval: placeholder until evaluation lands."""
from gpt2lab.commands import not_yet


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="(not implemented yet) evaluation")
    p.set_defaults(func=not_yet("eval", "evaluation"))
