"""Which Hugging Face class can hold a model: GPT2LMHeadModel for a model GPT-2 computes (``bias`` false:
GPT-2 with zero biases), NanoChatForCausalLM for one NanoChat computes, else why neither (each field,
and what the nearer one would need). The run plan shows it; ``gpt2lab export`` refuses in one line.
A pure function of a GPTConfig.

Training-only fields (the multi-token prediction heads) add weights that train the
model but compute none of its logits: no target needs them, the target names what it drops, and an
export writes the model without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gpt2lab.model.config import GPTConfig, flag_text
from gpt2lab.system.errors import UsageError


@dataclass(frozen=True)
class HFClass:
    """A Hugging Face class gpt2lab reads and writes: its ``architectures`` name, its config.json
    ``model_type``, and what a model must be for it to compute it: field -> (value, what it has)."""

    architecture: str
    model_type: str
    needs: dict


# An untied head GPT-2 has (tie_word_embeddings false), biases of zero stand for none; zero_init_proj
# and zero_init_head only set the initial weights, rope_theta matters only with rotary positions.
GPT2_HF = HFClass(
    "GPT2LMHeadModel",
    "gpt2",
    {
        "pos_emb": ("learned", "learned positions only"),
        "norm": ("layernorm", "LayerNorm only"),
        "qk_norm": (False, "no QK-norm"),
        "mlp_act": ("gelu", "tanh GELU only"),
        "embed_norm": (False, "no norm of the embeddings"),
        "logit_softcap": (0.0, "no logit softcap"),
        "value_embeds": (0, "no value embeddings"),
        "unet_skips": (False, "no skips between blocks"),
    },
)
NANOCHAT_HF = HFClass(
    "NanoChatForCausalLM",
    "nanochat",
    {
        "pos_emb": ("rotary", "rotary positions only"),
        "norm": ("rmsnorm", "RMSNorm only"),
        "qk_norm": (True, "always RMS-normalises q and k"),
        "bias": (False, "no biases"),
        "embed_norm": (True, "always RMS-normalises the embeddings"),
        "value_embeds": (0, "no value embeddings"),
        "unet_skips": (False, "no skips between blocks"),
    },
)


def gaps(config: GPTConfig, needs: dict) -> list[str]:
    """The fields of ``config`` a target with ``needs`` does not compute, as ``field=value``."""
    return [f"{k}={flag_text(getattr(config, k))}" for k, (v, _) in needs.items() if getattr(config, k) != v]


@dataclass(frozen=True)
class ExportTarget:
    """What ``gpt2lab export`` writes for a model: ``name`` (GPT2LMHeadModel, NanoChatForCausalLM) or
    None, and then ``why``: each field that keeps it from both, and what the nearer one would need.
    ``dropped``: the training-only fields it leaves out, as ``field=value (what export does)``."""

    name: Optional[str]
    why: str = ""
    dropped: tuple[str, ...] = ()

    def describe(self) -> str:
        if not self.name:
            return f"none ({self.why})"
        return f"Hugging Face {self.name}" + (f"; drops {', '.join(self.dropped)}" if self.dropped else "")


def export_target(config: GPTConfig) -> ExportTarget:
    """The Hugging Face model that computes ``config``'s logits (GPT-2 first), or why none does."""
    g, n = gaps(config, GPT2_HF.needs), gaps(config, NANOCHAT_HF.needs)
    if not g or not n:
        name = (GPT2_HF if not g else NANOCHAT_HF).architecture
        # the multi-token prediction heads: their weights train the model but compute none of its logits
        mtp = f"mtp_heads={config.mtp_heads} (multi-token prediction heads, a training loss: not written)"
        return ExportTarget(name, dropped=(mtp,) if config.mtp_heads else ())
    neither = [x for x in g if x in n]
    parts = [f"{x} (GPT-2 and NanoChat: {GPT2_HF.needs[x.split('=')[0]][1]})" for x in neither]
    nearer, missing = (GPT2_HF, g) if len(g) < len(n) else (NANOCHAT_HF, n)
    rest = [x.split("=")[0] for x in missing if x not in neither]
    if rest:
        wants = ", ".join(f"{k}={flag_text(nearer.needs[k][0])} ({nearer.needs[k][1]})" for k in rest)
        parts.append(f"{nearer.architecture} would {'also ' if neither else ''}need {wants}")
    return ExportTarget(None, "; ".join(parts))


def check_exportable(config: GPTConfig) -> ExportTarget:
    """The export target; one line (a UsageError, exit 2) when neither GPT-2 nor NanoChat computes this model."""
    target = export_target(config)
    if target.name is None:
        raise UsageError(
            f"export writes Hugging Face GPT-2 or NanoChat, and neither computes this model: "
            f"{target.why}; nothing was written. sample, serve and eval run it natively; to export, "
            "train without those fields"
        )
    return target
