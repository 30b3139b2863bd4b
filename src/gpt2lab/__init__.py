"""gpt2lab: reproduce and train GPT-2-class language models.

The Python API: ``GPT`` and ``GPTConfig`` (the network), ``get_tokenizer`` (GPT-2 BPE),
``from_pretrained`` (a model from anything ``gpt2lab sample --model`` takes: a GPT-2 hub name,
an HF directory, a run directory, a checkpoint), ``save_pretrained`` (write an HF directory: GPT-2 or NanoChat)
and ``generate`` (sample a continuation). ``GPT.from_pretrained(...)`` and ``model.generate(...)``
call ``from_pretrained`` and ``generate``, for hands used to nanoGPT and transformers. Each is
imported on first use, so that ``import gpt2lab`` (and commands that need no model, such as ``prepare``) do not
pay for importing torch.
"""
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["GPT", "GPTConfig", "get_tokenizer", "from_pretrained", "save_pretrained", "generate", "__version__"]

# public name -> the module that defines it
_API = {
    "GPT": "gpt2lab.model.gpt",
    "GPTConfig": "gpt2lab.model.config",
    "get_tokenizer": "gpt2lab.data.tokenizer",
    "from_pretrained": "gpt2lab.weights.load",
    "save_pretrained": "gpt2lab.weights.hf",
    "generate": "gpt2lab.inference.generate",
}

if TYPE_CHECKING:
    from gpt2lab.data.tokenizer import get_tokenizer
    from gpt2lab.inference.generate import generate
    from gpt2lab.model.config import GPTConfig
    from gpt2lab.model.gpt import GPT
    from gpt2lab.weights.hf import save_pretrained
    from gpt2lab.weights.load import from_pretrained


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'gpt2lab' has no attribute {name!r}")
