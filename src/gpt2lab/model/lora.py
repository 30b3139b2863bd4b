"""LoRA (Hu et al. 2021) through Hugging Face ``peft``: adapters on GPT's nn.Linear layers.

``add_lora`` puts peft's LoRA layers in place of the named Linears of a GPT, in place:
the model stays a ``GPT`` (generation, checkpoints and FLOP counts keep working) and only
the adapters' A and B matrices keep ``requires_grad``. A checkpoint stores the frozen base
weights and the adapters under peft's names (``c_attn.base_layer.weight``,
``c_attn.lora_A.default.weight``); ``merge_lora`` folds the adapters into the base
weights with peft's own merge, giving back a plain GPT for sample, eval and export.
peft is an optional extra (``pip install gpt2lab[lora]``), imported only here.
"""

from __future__ import annotations

from gpt2lab.model.gpt import GPT
from gpt2lab.system.errors import ConfigError


def add_lora(model: GPT, rank: int, alpha: float, targets: str):
    """Give ``model`` LoRA adapters of ``rank`` on the comma-separated ``targets``; freeze the rest.

    Returns peft's ``LoraModel`` around ``model`` (for ``merge_lora``). B starts at zero
    (peft's default), so the adapted model computes exactly what the base did until the
    first step.
    """
    try:
        import peft
    except ImportError as e:
        raise ConfigError(
            f"--lora-rank needs Hugging Face peft ({e}); pip install 'gpt2lab[lora]' or set --lora-rank 0"
        ) from e
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", target_modules=[t.strip() for t in targets.split(",")]
    )
    return peft.LoraModel(model, config, "default")  # peft's adapter name; replaces the Linears, freezes the base


def merge_lora(lora_model) -> GPT:
    """The GPT with its adapters folded into the base weights and plain nn.Linear layers back."""
    model = lora_model.merge_and_unload()
    model.requires_grad_(True)
    return model
