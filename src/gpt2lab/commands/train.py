"""gpt2lab train: placeholder until training lands."""
from gpt2lab.commands import not_yet


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="(not implemented yet) training")
    p.set_defaults(func=not_yet("train", "training"))
