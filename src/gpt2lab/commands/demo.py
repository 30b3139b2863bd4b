"""gpt2lab demo: placeholder until the demo lands."""
from gpt2lab.commands import not_yet


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="(not implemented yet) the demo")
    p.set_defaults(func=not_yet("demo", "the demo"))
