"""gpt2lab: reproduce and train GPT-2-class language models.

The Python API: ``GPT`` and ``GPTConfig`` (the network), ``from_pretrained`` (a model from anything
``gpt2lab sample --model`` takes: a GPT-2 hub name, an HF directory, a run directory, a checkpoint;
the model carries its tokenizer), ``get_tokenizer`` (the tokenizer of any such source, read from it;
no argument: GPT-2's BPE), ``save_pretrained`` (write an HF directory: GPT-2 or NanoChat),
``generate`` (sample a continuation of token ids with the model as it is; ``model.generate`` is the
same) and ``for_inference`` (a copy of a model held for fast decoding by the device's rule, no timing).
None of them measures, prints or writes anything it was not asked to. Each is imported on first use,
so that ``import gpt2lab`` (and commands that need no model, such as ``prepare``) do not pay for
importing torch.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"
# public name -> the module that defines it
_API = {
    "GPT": "gpt2lab.model.gpt",
    "GPTConfig": "gpt2lab.model.config",
    "get_tokenizer": "gpt2lab.weights.load",
    "from_pretrained": "gpt2lab.weights.load",
    "save_pretrained": "gpt2lab.weights.export",
    "generate": "gpt2lab.model.sampling",
    "for_inference": "gpt2lab.inference.form",
}
__all__ = [*_API, "__version__"]

if TYPE_CHECKING:  # for type checkers and editors: the same names, each re-exported ("as" itself)
    from gpt2lab.inference.form import for_inference as for_inference
    from gpt2lab.model.config import GPTConfig as GPTConfig
    from gpt2lab.model.gpt import GPT as GPT
    from gpt2lab.model.sampling import generate as generate
    from gpt2lab.weights.export import save_pretrained as save_pretrained
    from gpt2lab.weights.load import from_pretrained as from_pretrained
    from gpt2lab.weights.load import get_tokenizer as get_tokenizer


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'gpt2lab' has no attribute {name!r}")
