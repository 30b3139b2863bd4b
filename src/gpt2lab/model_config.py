"""GPTConfig: the one definition of the architecture (re-exported by gpt2lab.model).

It lives apart from model.py only so that building the CLI (whose ``--n-layer``-style
flags come from these fields) does not import torch. Each field's ``help`` becomes its
flag's help text; a field marked ``derived`` is set by the trainer, never by a flag.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

# The GPT-2 BPE's vocabulary (tokenizer.py builds it; here, torch- and tiktoken-free, for config.py too).
GPT2_VOCAB_SIZE = 50257


def _f(default: Any, help: str, derived: bool = False, shape: bool = False) -> Any:
    # shape: the field sets parameter shapes (a checkpoint loads only into the same values)
    return field(default=default, metadata={"help": help, "derived": derived, "shape": shape})


@dataclass
class GPTConfig:
    n_layer: int = _f(12, "transformer blocks", shape=True)
    n_head: int = _f(12, "attention heads per block", shape=True)
    n_embd: int = _f(768, "width of the residual stream", shape=True)
    block_size: int = _f(1024, "longest sequence the model accepts (rows of the position embedding)",
                         shape=True)
    vocab_size: int = _f(50257, "rows of wte / lm_head; 50304 = 50257 padded to a multiple of 128 for "
                         "speed", shape=True)
    # Rows of wte at or above it are padding: trained like any other but never sampled and
    # dropped on export. None means vocab_size. A run derives it from the tokenizer.
    token_vocab_size: Optional[int] = _f(None, "the tokenizer's vocabulary (rows past it are padding)",
                                         derived=True)
    layer_norm_epsilon: float = _f(1e-5, "epsilon of every LayerNorm")
    # Dropout as GPT-2 has it (HF's names). Active only in training mode.
    embd_pdrop: float = _f(0.0, "dropout on the token + position embeddings (GPT-2 fine-tuning: 0.1)")
    attn_pdrop: float = _f(0.0, "dropout on the attention weights")
    resid_pdrop: float = _f(0.0, "dropout on each residual branch's output")

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}; "
                             "change one of them")
        if self.token_vocab_size is not None and not 1 <= self.token_vocab_size <= self.vocab_size:
            raise ValueError(f"token_vocab_size {self.token_vocab_size} must be in [1, vocab_size "
                             f"{self.vocab_size}]")
        for name in ("embd_pdrop", "attn_pdrop", "resid_pdrop"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} {getattr(self, name)} must be in [0, 1)")

    @property
    def real_vocab_size(self) -> int:
        return self.token_vocab_size or self.vocab_size

    def to_dict(self) -> dict:
        return asdict(self)

    def shape(self) -> dict:
        """The fields that set parameter shapes, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata["shape"]}

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        """One of the four GPT-2 sizes by HF name or parameter count ('gpt2', '124M', ...)."""
        key = PRESET_ALIASES.get(name.lower(), name.lower())
        if key not in PRESETS:
            choices = ", ".join(sorted(PRESETS) + sorted(PRESET_ALIASES))
            raise ValueError(f"unknown GPT-2 size {name!r}; choose one of: {choices}")
        return cls(**{**PRESETS[key], **overrides})


# The four released GPT-2 sizes (Radford et al. 2019, table 2, as published on the hub).
PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
}
PRESET_ALIASES = {"124m": "gpt2", "350m": "gpt2-medium", "774m": "gpt2-large", "1558m": "gpt2-xl"}
