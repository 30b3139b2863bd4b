"""gpt2lab plot: placeholder until plots lands."""
from gpt2lab.commands import not_yet


def add_parser(sub) -> None:
    p = sub.add_parser("plot", help="(not implemented yet) plots")
    p.set_defaults(func=not_yet("plot", "plots"))
