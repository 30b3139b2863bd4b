"""The engine: one thread (``run_engine``: the main one under ``gpt2lab serve``) steps every model's worker
(serve/batch.py), so requests cannot corrupt each other; the events a worker sends a request's handler, and
the errors that end a request."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional, Union

import torch

from gpt2lab.inference.completion import TokenLogprob


@dataclass
class Text:
    index: int  # choice index: prompt number * n + sample number
    text: str
    logprobs: Optional[list[TokenLogprob]] = None  # the tokens it covers, when the request asks for logprobs


@dataclass
class Finish:
    index: int
    reason: str  # "stop" (<|endoftext|> or a stop string) or "length"
    tokens: int  # completion tokens sampled for this choice


Event = Union[Text, Finish, BaseException, None]  # an error: the request failed; None: it is complete


# each refusal's answer (serve/errors.failed): its HTTP status, OpenAI's error type and code
class QueueFull(Exception):
    """The worker's queue holds ``max_queue`` requests already."""

    answer = (429, "server_busy", "queue_full")


class TimedOut(Exception):
    """A request ran (or waited) past ``timeout_s``."""

    answer = (504, "timeout", "timeout")


class ShuttingDown(Exception):
    """The server is stopping (Ctrl-C): every open request ends with this error, a new one is refused."""

    answer = (503, "server_error", "server_shutting_down")


def run_engine(workers: dict) -> None:
    """Step every worker (name -> batch.Worker) in the calling thread, round robin, sleeping while all are
    idle, until every one is closed.

    This thread does all of the models' work; ``gpt2lab serve`` gives it its main thread (uvicorn serves
    from another). Why one thread, and the main one: an OpenMP runtime (libgomp, in PyTorch's CPU wheels)
    counts the threads of every thread's team, and once they outnumber the cores it stops spinning between
    parallel regions; a model run from a second thread after the main one has run torch ops then pays a
    wake-up per op. Measured on a 2-core Zen 5: the 124M model decodes 145 tokens/s from the main thread
    and 69 from another.
    """
    wake = threading.Event()
    for w in workers.values():
        w._wake = wake
    with torch.inference_mode():  # the caches' buffers are inference tensors: every update in them
        steps = {w: w._steps() for w in workers.values()}
        while steps:
            wake.clear()  # before looking: a request arriving from here on wakes the wait below
            busy = False
            for w, g in list(steps.items()):
                try:
                    busy = next(g) or busy
                except StopIteration:
                    del steps[w]
                finally:
                    w.deliver()
            if steps and not busy:
                wake.wait()
