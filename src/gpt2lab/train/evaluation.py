"""Periodic evaluation during training: validation loss (and its bits per byte), HellaSwag, a text
sample, the plot.

Every rank calls ``Evaluator.__call__`` at the start of each step (and once at the end);
what is due at that step runs on every rank (the losses are averaged over ranks, FSDP's
shards are gathered once), rank 0 alone logs, generates the sample and draws the plot.
A stop signal (``stopping``) ends each of them at its next batch or token, unlogged: every rank
still meets the others at an evaluation's sums, which carry the stop to all of them.
"""

from __future__ import annotations

import itertools
import os
from typing import Callable, Optional

import torch

from gpt2lab.distributed import parallel
from gpt2lab.distributed.dist import DistInfo, autocast
from gpt2lab.model.sampling import generate_stream
from gpt2lab.observe.metrics import MetricsLogger
from gpt2lab.train import preflight
from gpt2lab.train.config import TrainConfig


def due(interval: int, step: int, final: int) -> bool:
    """Whether something run every ``interval`` steps (0: never) is due at ``step`` (always at ``final``)."""
    return interval > 0 and (step % interval == 0 or step == final)


class Evaluator:
    """What runs between steps; ``raw`` is the GPT (sharded in place under FSDP), ``model`` what evaluates."""

    def __init__(
        self, cfg: TrainConfig, info: DistInfo, raw: torch.nn.Module, model: torch.nn.Module, dtype: str
    ) -> None:
        self.cfg, self.info, self.raw, self.model, self.dtype = cfg, info, raw, model, dtype
        self.stopping: Callable[[], bool] = bool  # whether this process got a stop signal (the Trainer's)
        self.device = info.device
        self.eval_tokens: Optional[int] = None  # --eval-tokens, or all the val split holds (preflight.eval_tokens)

    def any_due(self, step: int) -> bool:
        """Whether anything (val loss, HellaSwag, a sample) runs at ``step``."""
        ev, last = self.cfg.eval, self.cfg.optim.max_steps
        return any(due(i, step, last) for i in (ev.eval_interval, ev.hellaswag_interval, ev.sample_interval))

    def __call__(self, step: int, log: MetricsLogger) -> bool:
        """Run and log what is due at ``step``; whether anything was (what a stop cut short is not logged)."""
        ev, last = self.cfg.eval, self.cfg.optim.max_steps
        if due(ev.eval_interval, step, last):
            res = self.validate()
            if res is not None:
                log.log({"step": step, "val_loss": res.loss, "val_bpb": res.bpb})
        if due(ev.hellaswag_interval, step, last):
            from gpt2lab.evals.hellaswag import evaluate_hellaswag

            with parallel.gathered(self.raw):  # FSDP: ranks score different numbers of batches
                res = evaluate_hellaswag(self.model, ev.hellaswag_data, limit=ev.hellaswag_limit, **self._shared())
            if res is not None:
                log.log({"step": step, **{f"hellaswag_{k}": res[k] for k in ("acc", "acc_norm", "n")}})
        if due(ev.sample_interval, step, last):
            with parallel.gathered(self.raw):  # FSDP: every rank gathers; rank 0 alone generates
                text = self.sample() if self.info.is_main else None
            if text is not None:
                log.log({"step": step, "sample": text})
        if self.info.is_main and (due(ev.eval_interval, step, last) or due(ev.hellaswag_interval, step, last)):
            plot(self.cfg.out)
        return self.any_due(step)

    def validate(self):
        """The validation loss with its bits per byte (an evals.loss.LossResult; None: cut short by a stop)."""
        from gpt2lab.evals.loss import evaluate

        cfg = self.cfg
        if self.eval_tokens is None:  # the start said so when it trims
            self.eval_tokens = preflight.eval_tokens(cfg, self.info.world_size)
        with parallel.gathered(self.raw):  # FSDP: one all-gather, not one per block and batch
            return evaluate(self.model, cfg.data, tokens=self.eval_tokens, seq_len=cfg.batch.seq_len, **self._shared())

    def _shared(self) -> dict:
        """What the validation loss and HellaSwag are both given: batch size, device, dtype and the stop."""
        return dict(
            batch_size=self.cfg.batch.micro_batch_size, device=self.device, dtype=self.dtype, stop=self.stopping
        )

    @torch.no_grad()
    def sample(self) -> Optional[str]:
        """A continuation of the fixed prompt (uncompiled model: generation has varying shapes); a chat
        model's reply to it as a user's message. None: a stop signal came first (looked at every token)."""
        from gpt2lab.data.chat import encode_chat
        from gpt2lab.data.tokenizer import for_config

        prompt, chat = self.cfg.eval.sample_prompt, self.cfg.model.chat_template is not None
        enc = for_config(self.cfg.model, self.raw.tokenizer)
        ids = (
            encode_chat([("user", prompt)], add_generation_prompt=True, tokenizer=enc)[0]
            if chat
            else enc.encode(prompt, allowed_special="all") or [enc.eot_id]  # no prompt: a document's start
        )
        stop = enc.im_end_id if chat else enc.eot_id
        idx = torch.tensor([ids], device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(42)  # own generator: training RNG untouched
        self.raw.eval()
        # eager: under FSDP the blocks are compiled in place, and generation has varying shapes
        with autocast(self.device, self.dtype), torch.compiler.set_stance("force_eager"):
            # the model as it trains (no second copy of the weights beside the optimizer's state)
            stream = generate_stream(
                self.raw, idx, self.cfg.eval.sample_tokens, top_k=50, generator=gen, stop_token=stop
            )
            new = [int(t) for t, _ in itertools.takewhile(lambda _: not self.stopping(), stream)]  # a token at a time
        self.raw.train()
        if self.stopping():
            return None
        if chat:
            return f"User: {prompt}\nAssistant: " + enc.decode([t for t in new if t != stop])
        return enc.decode([t for t in ids + new if t != enc.eot_id])


def plot(run_dir: str) -> None:
    try:
        from gpt2lab.observe.plot import plot_runs
    except ImportError:  # matplotlib (the plot extra) not installed: plots are optional
        return
    plot_runs([run_dir], os.path.join(run_dir, "plot.png"))
