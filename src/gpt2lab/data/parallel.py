"""An ordered parallel map for ``gpt2lab prepare``: documents in, ``encode``'s results out, in the
documents' order, from a thread pool (small sources) or a process pool (large ones).

Documents are cut into tasks of about ``task_chars`` characters; ``encode`` turns one task (a
list of documents) into one result. Nothing here knows what ``encode`` makes or what becomes of
its results (data/prepare.py writes them into shards): the map only keeps the order, bounds how
far it reads ahead, and ends cleanly on an error or Ctrl-C.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, List, Optional, TypeVar

from gpt2lab.data.sources import Document
from gpt2lab.system.errors import GPT2LabError

R = TypeVar("R")
Encode = Callable[[List[Document]], R]

# Text per worker task: each message costs the main process ~1 ms, so big tasks; but a
# small source still gets ~8 tasks per worker so the workers stay evenly loaded.
TASK_CHARS_MIN, TASK_CHARS_MAX = 1 << 16, 1 << 20
TASK_DOCS = 4096
# Threads or processes (``use_threads``). tiktoken encodes with the GIL released, so threads
# run in parallel and start in microseconds, but the Python around the encoding (a .jsonl
# line's json.loads, the per-document copy: a share f of the work) takes turns; processes
# pay a start-up S (~100 ms) and never contend. For a source that takes W seconds on one
# core, w workers finish in about W*(f + (1-f)/w) as threads and S + W/w as processes, so
# processes win once W > S / (f * (1 - 1/w)). W and S are both CPU work that a faster
# machine shortens alike, so in bytes the crossover is the same on any machine; it moves
# only with w. Measured on 2 workers (docs/benchmarks.md): threads won on the ~1 MB bundled
# sources, processes on 20x them as .jsonl; the crossover there is this many bytes:
THREAD_POOL_MAX_BYTES = 8 << 20  # at 2 workers; use_threads scales it by 0.5 / (1 - 1/w)


def use_threads(size_bytes: Optional[int], workers: int) -> bool:
    """Tokenize with threads (else processes): sources of known size below the crossover."""
    # one worker has no pool to pay for (a thread: it encodes while the main thread writes); the hub (size unknown)
    # is large
    return workers <= 1 or size_bytes is not None and size_bytes < THREAD_POOL_MAX_BYTES * 0.5 / (1 - 1 / workers)


def task_chars(size_bytes: Optional[int], workers: int) -> int:
    """Characters per task for a source of ``size_bytes`` (None or 0: unknown) on ``workers``."""
    size = size_bytes or TASK_CHARS_MAX * 8 * workers
    return min(TASK_CHARS_MAX, max(TASK_CHARS_MIN, size // (8 * workers)))


@contextmanager
def ordered_map(
    encode: Encode, docs: Iterable[Document], workers: int, size_bytes: Optional[int]
) -> Iterator[Iterator[R]]:
    """``encode``'s result per task of ``docs``, in order, from ``workers`` threads or processes
    (chosen by ``use_threads`` for a source of ``size_bytes``). ``encode`` holds whatever it needs
    (its tokenizer), built once by the caller: forked workers and threads share it.

    ``with ordered_map(...) as results: for r in results: ...``; leaving the block early (an error,
    Ctrl-C) stops the workers.
    """
    tasks = _tasks(docs, task_chars(size_bytes, workers))
    if use_threads(size_bytes, workers):
        executor: Executor = ThreadPoolExecutor(workers, thread_name_prefix="gpt2lab-prepare")
    else:  # fork on Linux: workers start in milliseconds with the tokenizer already built
        ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        executor = ProcessPoolExecutor(workers, ctx, initializer=_start_worker, initargs=(encode, os.getpid()))
        encode = _encode_in_worker  # the worker's own copy, set once by _start_worker: not sent with each task
    try:
        yield _ordered(executor, tasks, 2 * workers, encode)
    except BrokenProcessPool:
        raise GPT2LabError("a tokenizer worker died; run the same prepare command again to resume") from None
    finally:  # Ctrl-C or an error: drop queued tasks, let running ones (<= 1 MB of text) end
        executor.shutdown(wait=True, cancel_futures=True)


def _tasks(docs: Iterable[Document], chars_per_task: int) -> Iterator[List[Document]]:
    batch: List[Document] = []
    chars = 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc) if isinstance(doc, str) else len(doc.line)
        if chars >= chars_per_task or len(batch) >= TASK_DOCS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _ordered(executor: Executor, tasks: Iterator[List[Document]], window: int, encode: Encode):
    """Results of ``encode`` over ``tasks`` in order, at most ``window`` in flight
    (``Executor.map`` would read the whole source ahead)."""
    pending: deque = deque()  # on an error, the executor's shutdown cancels what is still queued
    for task in tasks:
        # a process pool forks its workers in submit: a Ctrl-C landing there waits until the new worker is
        # listed (one left out would take a shutdown's stop message and leave another worker waiting for ever)
        with _ctrl_c_after():
            pending.append(executor.submit(encode, task))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


@contextmanager
def _ctrl_c_after() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that lands in the block until it ends, then deliver it to the handler
    that was there (KeyboardInterrupt, as a rule). Blocking the signal in this thread is not enough:
    the kernel hands it to another thread of the process, and Python then raises it in the main thread
    anyway."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only
        return
    held: list[int] = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
    if held:
        signal.raise_signal(signal.SIGINT)


# -- a process worker ----------------------------------------------------------------------
_worker_encode: Optional[Encode] = None


def _start_worker(encode: Encode, parent: int) -> None:
    """Ignore Ctrl-C (a terminal's reaches the whole process group: the main process alone decides),
    and end once the main process is gone, even by kill -9 (a worker would wait for tasks for ever)."""
    global _worker_encode
    _worker_encode = encode
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_after, args=(parent,), daemon=True).start()


def _exit_after(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _encode_in_worker(task: List[Document]):
    return _worker_encode(task)
