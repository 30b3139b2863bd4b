"""gpt2lab sample: placeholder until sampling lands."""
from gpt2lab.commands import not_yet


def add_parser(sub) -> None:
    p = sub.add_parser("sample", help="(not implemented yet) sampling")
    p.set_defaults(func=not_yet("sample", "sampling"))
