"""Generation for the server: one worker per model, all run by one engine thread; what both modes share.

The worker, ``batch.BatchWorker``, runs every active request as rows of a batched decode step,
or with ``gpt2lab serve --deterministic`` in turns, each row exactly as ``gpt2lab sample`` runs it.
One thread (``run_engine``: the main one under ``gpt2lab serve``) runs the models, so requests
cannot corrupt each other; both bound the rows in
flight (``max_batch``) and the requests waiting (``max_queue``: past it ``submit`` raises
QueueFull; a request whose client left gives its place back at once, Job.cancel), and end a
request that outlives ``timeout_s``; ``Worker.shut_down`` ends every open request when the
server stops.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass
from typing import Optional, Union

import torch

from gpt2lab.inference.choice import Decision
from gpt2lab.inference.completion import Sampling, TokenLogprob
from gpt2lab.model.gpt import GPT
from gpt2lab.serve.limits import Limits
from gpt2lab.serve.metrics import ServeMetrics


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


class QueueFull(Exception):
    """The worker's queue holds ``max_queue`` requests already."""


class TimedOut(Exception):
    """A request ran (or waited) past ``timeout_s``."""


class ShuttingDown(Exception):
    """The server is stopping (Ctrl-C): every open request ends with this error, a new one is refused."""


@dataclass
class Work:
    """What one completion request asks of a worker."""

    prompts: list[list[int]]
    sampling: Sampling
    n: int
    seeds: list[int]  # one per prompt: the request's seed for each, or each its own random one
    stops: list  # the stop strings (str, or completion.StopString shared by the choices)
    echo: list[str]  # each prompt's text when echo is on, else []
    logprobs: Optional[int] = None  # report log-probabilities with this many top tokens (None: none)

    @property
    def scores_prompt(self) -> bool:
        """Echo with logprobs: the prompt's own tokens are scored (one forward of the prompt)."""
        return bool(self.echo) and self.logprobs is not None


class Job:
    """One request in a worker: what it asks, and the asyncio queue its handler reads."""

    def __init__(self, request: Work, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.request, self.loop = request, loop
        self.out: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = False  # its client went away (cancel)
        self.worker: Optional["Worker"] = None  # set by Worker.submit
        self.queued = False  # holds one of its worker's max_queue places (Worker.submit until _started)
        self.arrived = time.monotonic()
        self.deadline = self.arrived + timeout_s
        self.last_token: dict[int, float] = {}  # choice index -> when its last token was sampled

    def send(self, event: Event) -> None:
        """Into its worker's outbox, handed over when the step ends (Worker.deliver)."""
        if event is None:  # complete: no longer open
            self.worker._finished(self)
        self.worker.outbox.append((self, event))

    def cancel(self) -> None:
        """Its client went away (the handler calls this): the worker drops the job at its next step,
        and a queue place the job still held is given back now, so that a request arriving before
        that step is not refused with 429 for a place nobody uses."""
        self.cancelled = True
        if self.worker is not None:
            self.worker._started(self)

    def fail(self, error: BaseException) -> None:
        self.send(error)
        self.send(None)

    def ended(self, now: float) -> bool:
        """Its client went away, or its time is up."""
        return self.cancelled or now > self.deadline


class Worker:
    """Owns one model; the engine's thread (``run_engine``) is the one that ever runs it. Its ``_steps``
    (batch.BatchWorker's) is a generator that does one step of work per ``next`` and says whether it
    had any (False: idle until a request arrives)."""

    def __init__(
        self,
        name: str,
        model: GPT,
        device: torch.device,
        limits: Optional[Limits] = None,
        decision: Optional[Decision] = None,
        turns: bool = False,
    ) -> None:
        self.name, self.model, self.device = name, model, device  # a model held by serve/models.py (or as given)
        self.turns = turns  # --deterministic: rows take turns (batch.BatchWorker)
        self.decision = decision  # how it is held and why (inference/choice.py), where serve/models.py decided
        self.limits = limits or Limits()
        self.metrics = ServeMetrics()  # create_app swaps in the app's own
        self._new: collections.deque[Job] = collections.deque()  # submitted since the last step
        self._closed = False  # close: the engine stops running it
        self._lock = threading.Lock()
        self._waiting = 0  # submitted, not yet given a row (or a turn)
        self._rows = 0
        self._open: set[Job] = set()  # submitted, not yet complete: what shut_down ends
        self._stopping: Optional[ShuttingDown] = None  # set by shut_down: new requests are refused
        self._wake = threading.Event()  # the engine's: set when there is something to do
        self.outbox: list = []  # (job, event) sent since the last delivery, in the order sent

    @property
    def block_size(self) -> int:
        return self.model.config.block_size

    def submit(self, job: Job) -> None:
        """Queue ``job``, or raise QueueFull at once when ``max_queue`` requests are waiting already."""
        with self._lock:
            if self._stopping is not None:
                raise self._stopping
            if self._waiting >= self.limits.max_queue:
                raise QueueFull(
                    f"the server is busy: {self._waiting} requests are waiting for model "
                    f"'{self.name}' (--max-queue {self.limits.max_queue}); retry later"
                )
            self._waiting += 1
            job.worker, job.queued = self, True
            self._open.add(job)
        self._new.append(job)
        self._wake.set()

    def queue_depth(self) -> int:
        return self._waiting

    def active_rows(self) -> int:
        return self._rows

    def shut_down(self, error: ShuttingDown) -> int:
        """End every open request with ``error`` now and refuse new ones; call it once the engine has
        stopped stepping this worker (Ctrl-C under ``gpt2lab serve``: server.uvicorn_in_thread). Returns
        how many ended whose client was still there."""
        with self._lock:
            self._stopping = error
            jobs, self._open = list(self._open), set()
        ended = sum(not job.cancelled for job in jobs)  # before failing them: a handler cancels its job as it ends
        for job in jobs:
            self._started(job)  # its queue place, if it held one
            job.fail(error)
        self.deliver()  # after what a step a Ctrl-C cut short sent
        return ended

    def deliver(self) -> None:
        """Hand the events sent since the last delivery to their jobs' queues, in the order sent: one call an
        event loop, a wake-up of its thread a step, not one a token of every row. The engine calls it when a
        step ends; the worker, after a prompt's first token, so that the token does not wait for the decode
        step that follows in the same step."""
        sent, self.outbox = self.outbox, []
        by_loop: dict = {}
        for job, event in sent:
            by_loop.setdefault(job.loop, []).append((job.out, event))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_each, items)

    def _finished(self, job: Job) -> None:
        with self._lock:
            self._open.discard(job)

    def close(self) -> None:
        """Ask the engine to stop running this worker (after the step it is in)."""
        self._closed = True
        self._wake.set()

    def _arrived(self, into: collections.deque) -> bool:
        """Move the requests submitted since the last step into ``into``; False once closed."""
        while self._new:
            into.append(self._new.popleft())
        return not self._closed

    def _started(self, job: Job) -> None:
        """Give back ``job``'s queue place: when the worker starts or drops it, or its client leaves
        (Job.cancel), whichever comes first; the others find it given back already."""
        with self._lock:
            if job.queued:
                job.queued = False
                self._waiting -= 1

    def _end_early(self, job: Job) -> None:
        """End a job its client left (nobody reads the error) or one past its deadline."""
        if job.cancelled:
            job.send(None)
        else:
            job.fail(
                TimedOut(
                    f"the request took longer than the server's {self.limits.timeout_s:g} s timeout "
                    "(--timeout); ask for fewer tokens or retry when the server is less busy"
                )
            )

    def _token(self, job: Job, index: int) -> None:
        """Count a sampled token of choice ``index``; observe first-token or per-token latency."""
        now = time.monotonic()
        if not job.last_token:  # the request's first
            self.metrics.first_token.labels(self.name).observe(now - job.arrived)
        last = job.last_token.get(index)
        if last is not None:
            self.metrics.per_token.labels(self.name).observe(now - last)
        job.last_token[index] = now
        self.metrics.tokens.labels(self.name).inc()


def _put_each(items: list) -> None:
    for out, event in items:
        out.put_nowait(event)


def run_engine(workers: dict[str, Worker]) -> None:
    """Step every worker in the calling thread, round robin, sleeping while all are idle, until every one
    is closed.

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
