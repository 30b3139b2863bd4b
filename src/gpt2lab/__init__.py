"""gpt2lab: reproduce and train GPT-2-class language models."""
from gpt2lab.model import GPT, GPTConfig
from gpt2lab.tokenizer import get_tokenizer

__version__ = "0.1.0"
__all__ = ["GPT", "GPTConfig", "get_tokenizer", "__version__"]
