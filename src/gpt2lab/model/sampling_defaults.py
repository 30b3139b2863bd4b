"""The sampling defaults, defined once: ``gpt2lab sample``'s flags, the server's request fields when a
request leaves them out, ``generate()`` / ``model.generate`` and anything else that samples take them
from here. Torch-free, so the CLI can show them in its help without importing torch.

Top-k 50 is the GPT-2 reference recipe's (OpenAI's ``sample.py`` for GPT-2, nanoGPT and build-nanogpt
sample with it): a small model's long tail of unlikely tokens is where its text goes off the rails.
``top_k`` 0 keeps every token; ``top_p`` 1 keeps all the mass (nucleus sampling off).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0  # the model's own distribution; 0 is greedy
    top_k: int = 50  # the k most likely tokens; 0 keeps every token
    top_p: float = 1.0  # the smallest set holding this much of the mass; 1 keeps all of it


SAMPLING = SamplingDefaults()
