"""The one-place facts: the GPT-2 sizes table and the accelerator table, against independent figures."""

from __future__ import annotations

import pytest
import torch

from gpt2lab.model.config import GPT2_VOCAB_SIZE, PADDED_VOCAB_SIZE, PRESET_ALIASES, SIZES, GPTConfig
from gpt2lab.model.gpt import GPT
from gpt2lab.system.hardware import peak_flops


def hand_count(n_layer: int, n_embd: int, vocab: int = 50257, positions: int = 1024) -> int:
    """GPT-2's parameters written out: embeddings (tied head), per block two LayerNorms,
    c_attn (3C x C + 3C), attn c_proj (C x C + C), c_fc (4C x C + 4C), mlp c_proj (C x 4C + C),
    and the final LayerNorm."""
    C = n_embd
    block = 2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C)
    return vocab * C + positions * C + n_layer * block + 2 * C


@pytest.mark.parametrize("size", SIZES, ids=lambda s: s.label)
def test_size_table_params_match_the_model_and_a_hand_count(size):
    assert size.params == hand_count(size.n_layer, size.n_embd)
    with torch.device("meta"):
        model = GPT(GPTConfig.preset(size.hub))
    assert model.num_params() == size.params
    assert PRESET_ALIASES[size.label.lower()] == size.hub


def test_padded_vocab_is_the_next_multiple_of_128():
    assert PADDED_VOCAB_SIZE % 128 == 0 and 0 <= PADDED_VOCAB_SIZE - GPT2_VOCAB_SIZE < 128


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA H200 NVL", 835),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100 80GB PCIe", 312),
        ("Tesla T4", None),
        ("cpu", None),
    ],
)
def test_peak_flops_tell_the_h100_forms_apart(name, tflops):
    got = peak_flops(name)
    assert (got is None and tflops is None) or got == tflops * 1e12
