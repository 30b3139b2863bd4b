"""gpt2lab: reproduce and train GPT-2-class language models.

``GPT``, ``GPTConfig`` and ``get_tokenizer`` are imported on first use, so that
``import gpt2lab`` (and commands that need no model, such as ``prepare``) do not pay
for importing torch.
"""
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["GPT", "GPTConfig", "get_tokenizer", "__version__"]

if TYPE_CHECKING:
    from gpt2lab.model import GPT, GPTConfig
    from gpt2lab.tokenizer import get_tokenizer


def __getattr__(name: str):
    if name in ("GPT", "GPTConfig"):
        from gpt2lab import model

        return getattr(model, name)
    if name == "get_tokenizer":
        from gpt2lab.tokenizer import get_tokenizer

        return get_tokenizer
    raise AttributeError(f"module 'gpt2lab' has no attribute {name!r}")
