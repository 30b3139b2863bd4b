"""GPTConfig: the one definition of the architecture (re-exported by gpt2lab.model.gpt).

It lives apart from model.py only so that building the CLI (whose ``--n-layer``-style
flags come from these fields) does not import torch. Each field's ``help`` becomes its
flag's help text; a field marked ``derived`` is set by the trainer, never by a flag.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

from gpt2lab.system.errors import ConfigError

# The GPT-2 BPE's vocabulary (tokenizer.py builds it; here, torch- and tiktoken-free, for config.py too).
GPT2_VOCAB_SIZE = 50257
# A chat template's tokenizer vocabulary: GPT-2's and the template's turn tokens (data/chat.py).
CHAT_VOCAB_SIZES = {"chatml": GPT2_VOCAB_SIZE + 2}


def setting(default: Any, help: str, within: Optional[str] = None, choices: tuple = (), **marks: bool | str) -> Any:
    """A config field (the architecture's and a run's): its default; ``help``, its flag's; ``within``, a number's
    range, an interval ("[0, 1)"), and ``choices``, a text field's values (both checked by check_fields); and marks
    read elsewhere. GPTConfig's: ``shape``, the field sets parameter shapes (a checkpoint loads only into the same
    values); ``arch``, it changes what the weights compute, so ``--init-from`` takes it from the source (as every
    shape field); ``derived``, the run sets it, no flag. A run's (train/config.py): ``keep``."""
    return field(default=default, metadata=dict(help=help, within=within, choices=choices, **marks))


# The ranges number fields declare most (``within``: any interval, "[a, b)", "(a, b]", read by check_fields).
AT_LEAST_1, AT_LEAST_0, ABOVE_0, FRACTION = "[1, inf)", "[0, inf)", "(0, inf)", "[0, 1)"


def check_fields(config: Any) -> None:
    """Each field of the dataclass ``config`` among its declared ``choices`` and ``within`` its declared
    range (an interval, "[0, 1)"; an optional field unset, None, passes); else a ConfigError naming it. The one
    check of a field's own value, for the architecture and every section of a run's settings alike."""
    for f in fields(config):
        value, choices, within = getattr(config, f.name), f.metadata.get("choices"), f.metadata.get("within")
        if choices and value is not None and value not in choices:
            raise ConfigError(f"{f.name} {value!r}: choose one of {', '.join(choices)}")
        if within is None or value is None:
            continue
        low, high = within[1:-1].split(", ")
        above = float(low) <= value if within[0] == "[" else float(low) < value
        if not (above and (value <= float(high) if within[-1] == "]" else value < float(high))):
            bound = f"in {within}" if high != "inf" else f"{'>=' if within[0] == '[' else '>'} {low}"
            raise ConfigError(f"{f.name} {value} must be {bound}")


# The modern block's switches (modded-nanogpt's speedrun record log measures each). Every
# default is GPT-2's, so presets, checkpoints and the gpt2 logits = transformers test are unchanged.
POS_EMB = ("learned", "rotary")
NORMS = ("layernorm", "rmsnorm")
MLP_ACTS = ("gelu", "relu2")


@dataclass
class GPTConfig:
    n_layer: int = setting(12, "transformer blocks", AT_LEAST_1, shape=True)
    n_head: int = setting(12, "attention heads per block", AT_LEAST_1, shape=True)
    n_embd: int = setting(768, "width of the residual stream", AT_LEAST_1, shape=True)
    block_size: int = setting(1024, "longest sequence the model accepts", AT_LEAST_1, shape=True)
    vocab_size: int = setting(50257, "rows of wte and lm_head (50304: GPT-2's 50257, padded)", AT_LEAST_1, shape=True)
    # Rows of wte at or above it are padding: trained like any other but never sampled and
    # dropped on export. None means vocab_size. A run derives it from the tokenizer.
    token_vocab_size: Optional[int] = setting(None, "the tokenizer's vocabulary", AT_LEAST_1, derived=True)
    # A chat model's template (data/chat.py: "chatml", whose two turn tokens make the tokenizer's
    # vocabulary 50259); None for a base model. A run derives it from its data (or its --init-from).
    chat_template: Optional[str] = setting(None, "chat template", derived=True, choices=tuple(CHAT_VOCAB_SIZES))
    # The tokenizer's identity: the sha256 of its tokenizer.json (data/tokenizer.py; `gpt2lab tokenizer
    # train`), whose file travels with the model; None for GPT-2's BPE. A run derives it from its data.
    tokenizer: Optional[str] = setting(None, "sha256 of the model's own tokenizer.json; none: GPT-2's", derived=True)
    layer_norm_epsilon: float = setting(1e-5, "epsilon of every LayerNorm", ABOVE_0)
    # Dropout as GPT-2 has it (HF's names). Active only in training mode.
    embd_pdrop: float = setting(0.0, "dropout on the embeddings (GPT-2 fine-tuning: 0.1)", FRACTION)
    attn_pdrop: float = setting(0.0, "dropout on the attention weights", FRACTION)
    resid_pdrop: float = setting(0.0, "dropout on each residual branch's output", FRACTION)
    # The modern block (docs/recipes.md, "A modern block"): each off by default, any combination allowed.
    pos_emb: str = setting("learned", "positions: learned (GPT-2's wpe) or rotary (RoPE)", shape=True, choices=POS_EMB)
    rope_theta: float = setting(10000.0, "rotary base (theta)", ABOVE_0, arch=True)
    norm: str = setting("layernorm", "the norm layers: layernorm (GPT-2's) or rmsnorm", shape=True, choices=NORMS)
    qk_norm: bool = setting(False, "RMS-normalise each head's queries and keys", arch=True)
    mlp_act: str = setting("gelu", "MLP activation: gelu (GPT-2's) or relu2 (relu(x)^2)", arch=True, choices=MLP_ACTS)
    tie_embeddings: bool = setting(True, "lm_head shares wte's matrix (GPT-2); false: its own", shape=True)
    bias: bool = setting(True, "biases in every Linear and LayerNorm (GPT-2); false: none", shape=True)
    embed_norm: bool = setting(False, "RMS-normalise the embedding before the first block", arch=True)
    zero_init_proj: bool = setting(False, "start each block's output projections (c_proj) at zero")
    logit_softcap: float = setting(0.0, "cap the logits smoothly: X tanh(logits / X) (0 = off)", AT_LEAST_0, arch=True)
    # The open GPT-2 speedrun's levers (modded-nanogpt's record log): each off by default.
    value_embeds: int = setting(
        0, "K more token tables mixed into the values of the first and last K layers (0 = off)", AT_LEAST_0, shape=True
    )
    unet_skips: bool = setting(False, "U-net skips: block i's output, weighted, into block n_layer-1-i", shape=True)
    zero_init_head: bool = setting(False, "start an untied lm_head at zero")
    # Multi-token prediction (Gloeckle et al. 2024; DeepSeek-V3's MTP): a training loss only. Its heads
    # are written to checkpoints but never exported (weights/targets.py: export_target).
    mtp_heads: int = setting(
        0, "multi-token prediction: K more heads for tokens t+2..t+K+1, training only (0 = off)", AT_LEAST_0, shape=True
    )
    mtp_weight: float = setting(0.3, "multi-token prediction: loss weight at step 0", AT_LEAST_0)
    mtp_weight_final: Optional[float] = setting(None, "mtp: loss weight at the last step (none: same)", AT_LEAST_0)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}; change one of them")
        if self.token_vocab_size is not None and self.token_vocab_size > self.vocab_size:
            raise ValueError(f"token_vocab_size {self.token_vocab_size} must be in [1, vocab_size {self.vocab_size}]")
        if self.pos_emb == "rotary" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"rotary positions need an even head size; n_embd / n_head = {self.n_embd // self.n_head}")
        if self.tokenizer is not None and not re.fullmatch(r"[0-9a-f]{64}", str(self.tokenizer)):
            raise ValueError(f"tokenizer {self.tokenizer!r} must be the sha256 (64 hex digits) of a tokenizer.json")
        if 2 * self.value_embeds > self.n_layer:
            raise ValueError(f"value_embeds {self.value_embeds} must be in [0, n_layer / 2] (n_layer {self.n_layer})")
        if self.unet_skips and self.n_layer < 2:
            raise ValueError("unet_skips needs n_layer >= 2 (block i feeds block n_layer-1-i for i < n_layer // 2)")
        if self.mtp_heads >= self.block_size:
            raise ValueError(
                f"mtp_heads {self.mtp_heads} must be in [0, block_size {self.block_size}) (head d predicts "
                "the token d+1 places after its own position, inside the sequence)"
            )
        if self.zero_init_head and self.tie_embeddings:
            raise ValueError("zero_init_head needs tie_embeddings false (a tied lm_head is wte, the token embedding)")

    @property
    def real_vocab_size(self) -> int:
        return self.token_vocab_size or self.vocab_size

    @property
    def template_vocab(self) -> int:
        """GPT-2's BPE vocabulary with this model's chat template's turn tokens (a trained tokenizer aside)."""
        return CHAT_VOCAB_SIZES[self.chat_template] if self.chat_template else GPT2_VOCAB_SIZE

    def modern(self) -> dict:
        """The modern-block and lever fields (declared from ``pos_emb`` to ``mtp_heads``: what a GPT-2 does
        not have) set away from GPT-2's defaults, by name."""
        names, base = [f.name for f in fields(self)], GPTConfig()
        modern = names[names.index("pos_emb") : names.index("mtp_heads") + 1]
        return {n: getattr(self, n) for n in modern if getattr(self, n) != getattr(base, n)}

    def shape(self) -> dict:
        """The fields that set parameter shapes, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("shape")}

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        """One of the four GPT-2 sizes by HF name or parameter count ('gpt2', '124M', ...)."""
        key = PRESET_ALIASES.get(name.lower(), name.lower())
        if key not in PRESETS:
            choices = ", ".join(sorted(PRESETS) + sorted(PRESET_ALIASES))
            raise ConfigError(f"unknown GPT-2 size {name!r}; choose one of: {choices}")
        return cls(**{**PRESETS[key], **overrides})


def flag_text(value: Any) -> str:
    """A field's value as its flag takes it (true/false, none), for messages."""
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


# -- the released GPT-2 sizes: the one table of their facts ------------------------------
# 50257 padded to a multiple of 128: the vocabulary gpt2lab trains with (faster matmuls).
PADDED_VOCAB_SIZE = 50304


def padded_vocab(n_vocab: int, multiple: int = 128) -> int:
    """The rows a model gives a tokenizer's vocabulary: a multiple of 128 (50257 -> PADDED_VOCAB_SIZE)."""
    return -(-n_vocab // multiple) * multiple


@dataclass(frozen=True)
class Size:
    """One released GPT-2 size (Radford et al. 2019, table 2, as published on the hub)."""

    label: str  # "124M"
    hub: str  # its name on the Hugging Face hub (openai-community/NAME)
    n_layer: int
    n_head: int
    n_embd: int
    params: int  # parameters: tied embeddings, vocab 50257, 1024 positions
    hellaswag_gpt2: float  # HellaSwag acc_norm of OpenAI's GPT-2 of this size
    hellaswag_gpt3: float  # and of GPT-3 at the same size (Brown et al. 2020)


SIZES = (
    Size("124M", "gpt2", 12, 12, 768, 124_439_808, 0.2955, 0.337),
    Size("350M", "gpt2-medium", 24, 16, 1024, 354_823_168, 0.375, 0.436),
    Size("774M", "gpt2-large", 36, 20, 1280, 774_030_080, 0.432, 0.510),
    Size("1558M", "gpt2-xl", 48, 25, 1600, 1_557_611_200, 0.489, 0.547),
)
HUB_NAMES = tuple(s.hub for s in SIZES)
PRESETS = {s.hub: dict(n_layer=s.n_layer, n_head=s.n_head, n_embd=s.n_embd) for s in SIZES}
PRESET_ALIASES = {s.label.lower(): s.hub for s in SIZES}


# -- the architecture in a run config (config.json, presets, flags) ------------------------
# GPTConfig's fields: flat keys of a run config that belong in its "model" section.
MODEL_KEYS = tuple(f.name for f in fields(GPTConfig))


def config_value(values: Mapping[str, Any], name: str, default: Any = None) -> Any:
    """A nested run config's field by its flat name (``"lora_rank"``): in its section's dict, or
    at the top level for data, out and seed. Flat names are unique over the sections, so no
    table is needed; ``default`` where the field is absent."""
    for table in values.values():
        if isinstance(table, dict) and name in table:
            return table[name]
    return values.get(name, default)


def check_types(values: dict, hints: dict, source: str, also: Optional[dict] = None) -> None:
    """Each value of the type its field's annotation names (an int passes for a float, a bool for
    nothing but a bool; a number is finite: TOML's ``inf`` and ``nan`` are no setting); else a
    ConfigError naming the key. ``also``: name -> other types allowed."""
    for name, value in values.items():
        if name not in hints:
            continue
        tp, optional = field_type(hints[name])
        ok = (value is None and optional) or (
            isinstance(value, (int, float) if tp is float else tp)
            and (tp is bool or not isinstance(value, bool))
            and (not isinstance(value, float) or math.isfinite(value))
        )
        if not ok and not isinstance(value, (also or {}).get(name, ())):
            kind = {int: "a whole number", float: "a number", bool: "true or false", str: "text"}.get(tp, str(tp))
            raise ConfigError(f"{source}: {name} must be {kind}, got {value!r}")


def model_from_config(values: Mapping[str, Any], source: str = "config") -> GPTConfig:
    """The architecture a run's or a checkpoint's config.json (nested, its version checked by its
    reader: system/formats.py) describes: its "model" section.

    Other fields are not checked (a checkpoint's training settings do not matter for
    sample, eval or export).
    """
    model = values.get("model", {})
    if not isinstance(model, dict):
        raise ConfigError(f'{source}: "model" must be a table of model fields ({", ".join(MODEL_KEYS)}), got {model!r}')
    unknown = sorted(set(model) - set(MODEL_KEYS))
    if unknown:
        raise ConfigError(
            f"{source}: unknown model field(s) {', '.join(unknown)}; known model fields: {', '.join(MODEL_KEYS)}"
        )
    check_types(model, get_type_hints(GPTConfig), source)
    try:
        return GPTConfig(**model)
    except ValueError as e:  # GPTConfig's own checks name the value
        raise ConfigError(f"{source}: {e}") from e


def field_type(tp: Any) -> tuple[Any, bool]:
    """(base type, optional?) of a field annotation such as ``Optional[int]``."""
    if get_origin(tp) is Union:  # Optional[X]: X
        return next(a for a in get_args(tp) if a is not type(None)), True
    return tp, False
