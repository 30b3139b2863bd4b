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


def _f(default: Any, help: str, derived: bool = False, shape: bool = False, arch: Optional[bool] = None,
       choices: tuple = ()) -> Any:
    # shape: the field sets parameter shapes (a checkpoint loads only into the same values).
    # arch: the field changes what the weights compute, so ``--init-from`` takes it from the
    # source (every shape field, and the modern block's switches). choices: a text field's values.
    return field(default=default, metadata={"help": help, "derived": derived, "shape": shape,
                                            "arch": shape if arch is None else arch, "choices": choices})


# The modern block's switches (issue 19; modded-nanogpt's speedrun record log measures each). Every
# default is GPT-2's, so presets, checkpoints and the gpt2 logits = transformers test are unchanged.
POS_EMB = ("learned", "rotary")
NORMS = ("layernorm", "rmsnorm")
MLP_ACTS = ("gelu", "relu2")


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
    # The modern block (README "A modern block"): each off by default, any combination allowed.
    pos_emb: str = _f("learned", "positions: learned (GPT-2's wpe table) or rotary (RoPE, Su et al. 2021: "
                      "q and k rotated per position, no table)", shape=True, choices=POS_EMB)
    rope_theta: float = _f(10000.0, "rotary base: pair i of a head turns at rope_theta^(-2i/head_size) "
                           "radians per position", arch=True)
    norm: str = _f("layernorm", "normalisation of every block input and of ln_f: layernorm (GPT-2) or "
                   "rmsnorm (a gain, no bias, no mean)", shape=True, choices=NORMS)
    qk_norm: bool = _f(False, "RMS-normalise each head's queries and keys (no gain) before attention", arch=True)
    mlp_act: str = _f("gelu", "MLP activation: gelu (tanh approximation, GPT-2) or relu2 (relu(x)^2)",
                      arch=True, choices=MLP_ACTS)
    tie_embeddings: bool = _f(True, "lm_head shares wte's matrix (GPT-2); false: a separate output matrix",
                              shape=True)
    zero_init_proj: bool = _f(False, "initialise the attention and MLP output projections (c_proj) to zero, "
                              "so every block starts as the identity")
    logit_softcap: float = _f(0.0, "cap the logits smoothly at +-X: X * tanh(logits / X); 0 = off", arch=True)

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
        for f in fields(self):
            if f.metadata["choices"] and getattr(self, f.name) not in f.metadata["choices"]:
                raise ValueError(f"{f.name} {getattr(self, f.name)!r} must be one of "
                                 f"{', '.join(f.metadata['choices'])}")
        if self.pos_emb == "rotary" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"rotary positions need an even head size; n_embd {self.n_embd} / n_head "
                             f"{self.n_head} = {self.n_embd // self.n_head}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta {self.rope_theta} must be > 0")
        if self.logit_softcap < 0:
            raise ValueError(f"logit_softcap {self.logit_softcap} must be >= 0 (0 = off)")

    @property
    def real_vocab_size(self) -> int:
        return self.token_vocab_size or self.vocab_size

    def modern(self) -> dict:
        """The modern-block fields set away from GPT-2's defaults, by name."""
        base = GPTConfig()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name in MODERN_FIELDS and getattr(self, f.name) != getattr(base, f.name)}

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
MODERN_FIELDS = ("pos_emb", "rope_theta", "norm", "qk_norm", "mlp_act", "tie_embeddings", "zero_init_proj",
                 "logit_softcap")
