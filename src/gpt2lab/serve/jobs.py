"""A request in the server's engine: the job a handler submits to its model's worker (serve/batch.py), the
events the worker sends back (``Text``, ``Finish``, an error, or None: complete), the errors that end a
request with their HTTP answers, and the engine (``run_engine``), the one thread that steps every model's
worker, so that requests cannot corrupt each other."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from gpt2lab.inference.completion import Sampling, TokenLogprob


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


@dataclass(eq=False)
class Job:
    """One completion request in a worker: what it asks, and the asyncio queue its handler reads (``submit``
    sets its loop, worker and deadline)."""

    prompts: list[list[int]]
    sampling: Sampling
    n: int = 1
    seeds: list[int] = field(default_factory=list)  # one per prompt: the request's seed, or each its own random one
    stops: list = field(default_factory=list)  # the stop strings (str, or completion.StopString shared by the choices)
    echo: list[str] = field(default_factory=list)  # each prompt's text when echo is on, else []
    logprobs: Optional[int] = None  # report log-probabilities with this many top tokens (None: none)

    def __post_init__(self) -> None:
        self.out: asyncio.Queue[Event] = asyncio.Queue()
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.worker = None  # the serve/batch.py Worker it was submitted to
        self.cancelled = False  # its client went away (cancel)
        self.queued = False  # holds one of its worker's max_queue places (submit until _started)
        self.rows_left = 0  # its prompts not finished, once started
        self.arrived = self.deadline = 0.0
        self.last_token: dict[int, float] = {}  # choice index -> when its last token was sampled

    @property
    def scores_prompt(self) -> bool:
        """Echo with logprobs: the prompt's own tokens are scored (one forward of the prompt)."""
        return bool(self.echo) and self.logprobs is not None

    def send(self, event: Event) -> None:
        """Into its worker's outbox, handed over when the step ends (Worker.deliver)."""
        if event is None:  # complete: no longer open
            with self.worker._lock:
                self.worker._open.discard(self)
        self.worker.outbox.append((self, event))

    def cancel(self) -> None:
        """Its client went away (the handler calls this): the worker drops the job at its next step,
        and a queue place the job still held is given back now, so that a request arriving before
        that step is not refused with 429 for a place nobody uses."""
        self.cancelled = True
        if self.worker is not None:
            self.worker._started(self)

    def fail(self, error: Optional[BaseException]) -> None:
        """End it: with ``error``, or (None) none, its client gone."""
        if error is not None:
            self.send(error)
        self.send(None)


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
