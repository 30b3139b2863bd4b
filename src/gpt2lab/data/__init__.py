"""Token shards, the prepare pipeline and the loader.

``from gpt2lab.data import TokenLoader`` is the public entry point for training scripts;
``gpt2lab.data.prepare.prepare`` turns text into shards (``gpt2lab prepare``).
"""

from gpt2lab.data.shards import ShardError


def __getattr__(name: str):
    # TokenLoader pulls in torch; prepare's worker processes should not have to.
    if name == "TokenLoader":
        from gpt2lab.data.loader import TokenLoader

        return TokenLoader
    raise AttributeError(f"module 'gpt2lab.data' has no attribute {name!r}")


__all__ = ["TokenLoader", "ShardError"]
