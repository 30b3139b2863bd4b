"""Token shards, the prepare pipeline and the loader.

``from gpt2lab.data import TokenLoader`` is the public entry point for training scripts;
``gpt2lab.data.prepare.prepare`` turns text into shards (``gpt2lab prepare``).
"""
from gpt2lab.data.loader import TokenLoader
from gpt2lab.data.shards import ShardError

__all__ = ["TokenLoader", "ShardError"]
