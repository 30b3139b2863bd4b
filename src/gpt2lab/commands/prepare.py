"""gpt2lab prepare: placeholder until the data pipeline lands."""
from gpt2lab.commands import not_yet


def add_parser(sub) -> None:
    p = sub.add_parser("prepare", help="(not implemented yet) the data pipeline")
    p.set_defaults(func=not_yet("prepare", "the data pipeline"))
