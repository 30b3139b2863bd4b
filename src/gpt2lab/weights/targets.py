"""Which Hugging Face class can hold a model: GPT2LMHeadModel for a model GPT-2 computes (``bias`` false:
GPT-2 with zero biases), NanoChatForCausalLM for one NanoChat computes, else why neither (each field,
and what the nearer one would need). The run plan shows it; ``gpt2lab export`` refuses in one line.
A pure function of a GPTConfig.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gpt2lab.model.config import GPTConfig
from gpt2lab.system.errors import UsageError
from gpt2lab.weights import gpt2, nanochat


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def gaps(config: GPTConfig, needs: dict) -> list[str]:
    """The fields of ``config`` a target with ``needs`` does not compute, as ``field=value``."""
    return [f"{k}={_show(getattr(config, k))}" for k, (v, _) in needs.items() if getattr(config, k) != v]


@dataclass(frozen=True)
class ExportTarget:
    """What ``gpt2lab export`` writes for a model: ``name`` (GPT2LMHeadModel, NanoChatForCausalLM) or
    None, and then ``why``: each field that keeps it from both, and what the nearer one would need."""

    name: Optional[str]
    why: str = ""

    def describe(self) -> str:
        return f"Hugging Face {self.name}" if self.name else f"none ({self.why})"


def export_target(config: GPTConfig) -> ExportTarget:
    """The Hugging Face model that computes ``config``'s logits (GPT-2 first), or why none does."""
    g, n = gaps(config, gpt2.NEEDS), gaps(config, nanochat.NEEDS)
    if not g or not n:
        return ExportTarget(gpt2.ARCHITECTURE if not g else nanochat.ARCHITECTURE)
    neither = [x for x in g if x in n]
    parts = [f"{x} (GPT-2 and NanoChat: {gpt2.NEEDS[x.split('=')[0]][1]})" for x in neither]
    name, needs, missing = (
        (gpt2.ARCHITECTURE, gpt2.NEEDS, g) if len(g) < len(n) else (nanochat.ARCHITECTURE, nanochat.NEEDS, n)
    )
    rest = [x.split("=")[0] for x in missing if x not in neither]
    if rest:
        wants = ", ".join(f"{k}={_show(needs[k][0])} ({needs[k][1]})" for k in rest)
        parts.append(f"{name} would {'also ' if neither else ''}need {wants}")
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
