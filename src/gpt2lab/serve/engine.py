"""Generation for the server: one worker thread per model; requests take turns token by token.

Why turns and not a batch: every request keeps its own KV cache and its own seeded
``torch.Generator`` and runs exactly the code ``gpt2lab sample`` runs (completion.py), so a
seeded request gives the same text whatever else is being served at the time. Batching
rows of different requests would change both the random draws and the matmul rounding.
The worker advances each active request by one token in turn, so every stream moves at
once (fair time to first token); one thread owns the model, so requests cannot corrupt
each other. The cost: 8 streams share one stream's tokens/s (see docs/benchmarks.md).
"""
from __future__ import annotations

import asyncio
import collections
import queue
import threading
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch

from gpt2lab.inference.completion import Sampling, seeded_generator, stream_text
from gpt2lab.distributed.dist import autocast
from gpt2lab.model.gpt import GPT


@dataclass
class Text:
    index: int  # choice index: prompt number * n + sample number
    text: str


@dataclass
class Finish:
    index: int
    reason: str  # "stop" (<|endoftext|> or a stop string) or "length"
    tokens: int  # completion tokens sampled for this choice


@dataclass
class Failed:
    error: BaseException


Event = Union[Text, Finish, Failed, None]  # None: the request is complete


class StopFilter:
    """Cuts a growing text at the first stop string; holds back a tail that may begin one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was reached)."""
        text = self.pending + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return text[:min(hits)], True
        hold = max((n for s in self.stops for n in range(len(s) - 1, 0, -1) if text.endswith(s[:n])), default=0)
        self.pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


def completion_events(model: GPT, prompts: list[list[int]], sampling: Sampling, *, n: int, seed: int,
                      stops: list[str], echo: list[str]) -> Iterator[Union[Text, Finish]]:
    """The events of one request, one token per step: each prompt gets a generator seeded
    with ``seed`` and its ``n`` samples one after another (as ``gpt2lab sample --num-samples n``)."""
    device = next(model.parameters()).device
    for p, ids in enumerate(prompts):
        generator = seeded_generator(device, seed)
        for i in range(n):
            index, tokens, stop = p * n + i, 0, StopFilter(stops)
            if echo:
                yield Text(index, echo[p])
            reason = None
            for tok, piece in stream_text(model, ids, sampling, generator):
                tokens += tok is not None
                text, hit = stop.feed(piece)
                if text or tok is not None:  # one event per token keeps the turns one token long
                    yield Text(index, text)
                if hit:
                    reason = "stop"
                    break
            if reason is None:
                yield Text(index, stop.flush())
                reason = "length" if tokens == sampling.max_new_tokens else "stop"
            yield Finish(index, reason, tokens)


class Job:
    """One request in a worker: its event iterator and the asyncio queue its handler reads."""

    def __init__(self, events: Iterator[Union[Text, Finish]], loop: asyncio.AbstractEventLoop) -> None:
        self.events, self.loop = events, loop
        self.out: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = False

    def send(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, event)


class ModelWorker:
    """Owns one model and the one thread that ever runs it."""

    def __init__(self, name: str, model: GPT, device: torch.device, dtype: str) -> None:
        self.name, self.model, self.device, self.dtype = name, model, device, dtype
        self._new: queue.Queue[Optional[Job]] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"gpt2lab-serve-{name}", daemon=True)
        self._thread.start()

    @property
    def block_size(self) -> int:
        return self.model.config.block_size

    def submit(self, job: Job) -> None:
        self._new.put(job)

    def close(self) -> None:
        self._new.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        active: collections.deque[Job] = collections.deque()
        while True:
            try:  # wait only when idle; otherwise pick up new requests between tokens
                while True:
                    job = self._new.get(block=not active)
                    if job is None:
                        return
                    active.append(job)
            except queue.Empty:
                pass
            job = active.popleft()
            if self._step(job):
                active.append(job)

    def _step(self, job: Job) -> bool:
        """Advance ``job`` by one event; False once it is finished, failed or cancelled."""
        if job.cancelled:
            job.events.close()
            return False
        try:
            with autocast(self.device, self.dtype):
                event = next(job.events)
        except StopIteration:
            job.send(None)
            return False
        except Exception as e:  # reported to this request only; the worker keeps serving
            job.send(Failed(e))
            job.send(None)
            return False
        job.send(event)
        return True
