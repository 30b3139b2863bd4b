"""gpt2lab export: placeholder until HF export lands."""
from gpt2lab.commands import not_yet


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="(not implemented yet) HF export")
    p.set_defaults(func=not_yet("export", "HF export"))
