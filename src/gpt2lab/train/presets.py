"""``gpt2lab train --list-presets``: every packaged preset, what it trains and what it costs.

Per preset: the model's size and parameter count, the recipe (GPT-2's or the modern one), steps
and tokens, the time it takes where it was measured, and what ``gpt2lab export`` makes of its
model (weights/targets.py). ``MEASURED`` is the one place in the package for the measured
times; each says its machine (the commands and conditions: docs/benchmarks.md, "The presets'
cost"). A GPU preset's time is its tokens at a throughput measured for that model and batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gpt2lab.train.memplan import params
from gpt2lab.train.schedule import accum_at
from gpt2lab.train.settings import load_preset, preset_names
from gpt2lab.weights.targets import export_target


@dataclass(frozen=True)
class Measured:
    """A preset's measured cost: ``wall_s``, seconds of the whole ``gpt2lab train --preset NAME`` (start-up,
    evaluations and checkpoints included), or ``tok_per_s``, the training throughput of its model and batch."""

    machine: str
    wall_s: Optional[float] = None
    tok_per_s: Optional[float] = None

    def describe(self, tokens: int) -> str:
        if self.wall_s is not None:
            return f"{self.wall_s / 60:.1f} min on {self.machine} (measured)"
        return f"{tokens / self.tok_per_s / 3600:.1f} h on {self.machine} (at {self.tok_per_s:,.0f} tok/s measured)"


# The CPU presets: `gpt2lab train --preset NAME` with the preset's own settings, one run at a time on a quiet
# machine, data/tinyshakespeare and data/wiki (docs/benchmarks.md, "The presets' cost").
XEON_AMX = "a 2-core Intel Xeon with AMX (bf16 autocast), torch 2.13"
# the same command on held-out Wikipedia articles (data/wikialt, seed 1337), evaluated every 12 steps
EPYC_ZEN4 = "a 2-core AMD EPYC Zen 4 (bf16 autocast), torch 2.13"
# gpt2-124m on one H100, B=64 x 8 micro-steps, compiled, bf16: docs/benchmarks.md, "Training speed on a GPU"
H100_124M = Measured("one NVIDIA H100 80GB HBM3", tok_per_s=486_800)
# gpt2-124m-record on one H200, the same batch: the median step of 30 (docs/benchmarks.md, "The GPU proof on one H200")
MEASURED = {
    "shakespeare-cpu": Measured(XEON_AMX, wall_s=48.7),
    "shakespeare-cpu-fast": Measured(XEON_AMX, wall_s=43.7),
    "wiki-cpu": Measured(XEON_AMX, wall_s=86.0),
    "wiki-cpu-fast": Measured(XEON_AMX, wall_s=51.3),
    "wiki-cpu-long": Measured(XEON_AMX, wall_s=368.7),
    "wiki-cpu-long-fast": Measured(EPYC_ZEN4, wall_s=184.5),
    "wiki-cpu-long-record": Measured(EPYC_ZEN4, wall_s=233.1),
    "gpt2-124m": H100_124M,
    "gpt2-124m-40b": H100_124M,  # the same model and batch, four times the steps
    "gpt2-124m-record": Measured("one NVIDIA H200", tok_per_s=434_530),
    # from a shakespeare-cpu-fast run, on the bundled conversations (docs/benchmarks.md, "Fine-tuning on conversations")
    "chat-cpu": Measured(XEON_AMX, wall_s=104.7),
}


# Presets that fine-tune a model given with --init-from rather than train one: what they do to it. The
# size the listing shows for one with no --init-from of its own is its base preset's, for a model that size.
FINE_TUNES = {
    "chat-cpu": "supervised fine-tuning on conversations, of the model given with --init-from RUN",
    "chat-gpt2": "supervised fine-tuning on conversations",
    "finetune-shakespeare": "fine-tuning",
}


def listing() -> list[str]:
    """``--list-presets``: each preset's lines. Its recipe: "faithful GPT-2" (GPT-2's block, AdamW, cosine) or
    "modern" (any modern-block field, lever or Muon/WSD), a fine-tuning preset's FINE_TUNES entry; its tokens:
    every step's, a batch ramp's smaller early steps included."""
    out = []
    for name in preset_names():
        cfg = load_preset(name)
        m, b, o, init, measured = cfg.model, cfg.batch, cfg.optim, cfg.finetune.init_from, MEASURED.get(name)
        ramp = min(o.max_steps, b.batch_ramp_steps)
        n = sum(accum_at(cfg, s, 1) for s in range(ramp)) * b.micro_batch_size * b.seq_len
        n += (o.max_steps - ramp) * b.total_batch_tokens
        modern = m.modern() or o.optimizer != "adamw" or o.lr_schedule != "cosine"
        recipe = FINE_TUNES.get(name) or f"{'modern' if modern else 'faithful GPT-2'} recipe"
        source = f" (the architecture comes from --init-from {init})" if init else ""
        out += [
            f"{name}: {m.n_layer} layers x {m.n_embd} wide, {params(cfg):,} parameters{source}; "
            f"{recipe}; {o.max_steps:,} steps, {n:,} tokens",
            f"    time    {measured.describe(n) if measured else 'not measured'}",
            f"    export  {export_target(m).describe()}",
        ]
    return out
