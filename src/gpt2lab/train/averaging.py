"""An exponential moving average of the weights as they train (``--ema-decay``).

After each optimizer step that was taken, ``avg = d * avg + (1 - d) * weights`` (the first
copies the weights), kept by ``torch.optim.swa_utils.AveragedModel``: a second GPT beside the
one being trained, in fp32 like it. The average is the model a run hands on: evaluations
(val loss, HellaSwag, samples) use it and a checkpoint's ``model.safetensors`` holds it, so
sample, serve, eval, export and ``--init-from`` read it unchanged; the weights as trained,
which a resume continues from, go to ``training.safetensors`` beside it (checkpoint.store).

Why: early in a run, at a high learning rate, the weights jitter around a valley's floor
and lean towards the last batches seen; their average sits nearer the floor, as a
learning-rate decay would, without stopping the training (docs/benchmarks.md, "The longer
horizon": "Averaging the weights"). Costs a copy of the parameters and one foreach lerp a step.
"""

from __future__ import annotations

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from gpt2lab.distributed import parallel
from gpt2lab.system.errors import ConfigError


class WeightAverage:
    """The running average of ``model``'s parameters; a checkpoint part (``state_dict`` holds
    how many steps it has averaged; its weights are saved as the checkpoint's model)."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        if parallel.is_sharded(model):
            raise ConfigError(
                "--ema-decay: the model is sharded (FSDP) and the average keeps whole weights; "
                "use --strategy ddp, or --ema-decay 0 with FSDP"
            )
        self.averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=False)

    @property
    def module(self) -> torch.nn.Module:
        """The averaged GPT (a copy of the trained one, never trained itself)."""
        return self.averaged.module

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        self.averaged.update_parameters(model)

    def state_dict(self) -> dict:
        return {"n_averaged": int(self.averaged.n_averaged.item())}  # the decay is the run config's

    def load_state_dict(self, state: dict) -> None:
        self.averaged.n_averaged.fill_(int(state["n_averaged"]))
