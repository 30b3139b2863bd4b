"""An ordered parallel map for ``gpt2lab prepare``: documents in, ``encode``'s results out, in the
documents' order, from a thread pool (small sources) or a process pool (large ones).

Documents are cut into tasks of about ``task_chars`` characters; ``encode`` turns one task (a
list of documents) into one result. Nothing here knows what ``encode`` makes or what becomes of
its results (data/prepare.py writes them into shards): the map only keeps the order, bounds how
far it reads ahead, and ends cleanly on an error or Ctrl-C.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import signal
import sys
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Callable, Iterable, Iterator, List, Optional, TypeVar

from gpt2lab.data.sources import Document

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
    # the hub (size unknown) is large; one worker has no pool to pay for
    return size_bytes is not None and (workers <= 1 or size_bytes < THREAD_POOL_MAX_BYTES * 0.5 / (1 - 1 / workers))


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
    if workers == 1:
        yield map(encode, tasks)
    elif use_threads(size_bytes, workers):
        executor = ThreadPoolExecutor(workers, thread_name_prefix="gpt2lab-prepare")
        try:
            yield _ordered(executor, tasks, 2 * workers, encode)
        finally:  # Ctrl-C or an error: drop queued tasks, let running ones (<= 1 MB of text) end
            executor.shutdown(wait=True, cancel_futures=True)
    else:
        with _process_pool(tasks, workers, encode) as results:
            yield results


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


def _ordered(executor: ThreadPoolExecutor, tasks: Iterator[List[Document]], window: int, encode: Encode):
    """Results of ``encode`` over ``tasks`` in order, at most ``window`` in flight
    (``Executor.map`` would read the whole source ahead)."""
    pending: deque = deque()  # on an error, the executor's shutdown cancels what is still queued
    for task in tasks:
        pending.append(executor.submit(encode, task))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


# -- the process pool --------------------------------------------------------------------
# multiprocessing.Pool is not used: its terminate() can deadlock when Ctrl-C lands while a
# worker is sending a result (it drains queues under locks a killed worker may hold), and
# every worker prints a KeyboardInterrupt traceback. Here each worker has its own two-way
# pipe and no lock is shared: task i goes to worker i % n and its result is read back
# from that worker, so the order is kept. Workers ignore SIGINT (a terminal's Ctrl-C
# reaches the whole process group); the main process alone decides, and on any way out
# but the normal one it SIGKILLs them, which cannot block.
POLL_S = 0.2  # how often a waiting main process checks that the workers are alive


def _worker(conn, encode: Encode, parents_ends: tuple = ()) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for c in parents_ends:  # a forked worker's copies of the main process's ends: once that process is
        c.close()  # gone (even by kill -9), no one holds the other end of its pipe and recv ends (EOFError)
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        try:
            reply = (True, encode(task))
        except Exception as e:  # SourceError of a bad line: the main process raises it, in order
            reply = (False, e)
        try:
            conn.send(reply)
        except (TypeError, AttributeError, pickle.PicklingError):  # an exception that does not pickle
            conn.send((False, RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}")))


@contextmanager
def _ctrl_c_after() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that lands in the block until it ends, then deliver it to the handler
    that was there (KeyboardInterrupt, as a rule). Blocking the signal in this thread is not enough:
    the kernel hands it to another thread of the process, and Python then raises it in the main thread
    anyway, possibly inside ``Process.start`` after the fork, where the new worker is not yet listed
    to be killed and lives on, holding the pipes (a caller waiting for their end waits for ever)."""
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


@contextmanager
def _process_pool(tasks: Iterator[List[Document]], workers: int, encode: Encode):
    # fork on Linux: workers start in milliseconds with the tokenizer already built
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    procs, conns = [], []
    # what the dispatch thread has done: it reads the source, cuts tasks and sends task i to worker i % n
    # (in the main process, beside the result loop, so a worker blocked sending a result never blocks the reading)
    sent = SimpleNamespace(tasks=0, done=False, error=None, stop=False)

    def dispatch() -> None:
        try:
            for task in tasks:
                if sent.stop:
                    return
                conns[sent.tasks % workers].send(task)
                sent.tasks += 1
            for c in conns:
                c.send(None)
        except BaseException as e:  # a source that cannot be read: raised in order by the reader
            if not sent.stop:
                sent.error = e
        finally:
            sent.done = True

    thread = threading.Thread(target=dispatch, name="gpt2lab-prepare-dispatch", daemon=True)
    try:
        with _ctrl_c_after():  # a worker forked as Ctrl-C lands is in procs, so it is killed with the rest
            for _ in range(workers):
                mine, theirs = ctx.Pipe()
                ends = (mine, *conns) if ctx.get_start_method() == "fork" else ()
                p = ctx.Process(target=_worker, args=(theirs, encode, ends), daemon=True, name="gpt2lab-prepare-worker")
                p.start()
                theirs.close()
                procs.append(p)
                conns.append(mine)
        thread.start()
        yield _results(sent, thread, procs, conns)
    except BaseException:
        for p in procs:  # SIGKILL: nothing a worker is doing can hold us up
            p.kill()
        raise
    finally:
        sent.stop = True
        if thread.is_alive():
            thread.join(5)
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in conns:
            c.close()


def _results(sent: SimpleNamespace, thread: threading.Thread, procs, conns) -> Iterator:
    i = 0
    while True:
        if sent.done and i >= sent.tasks:  # every task's result is in
            if sent.error is not None:
                raise sent.error
            return
        conn, proc = conns[i % len(conns)], procs[i % len(conns)]
        if not conn.poll(POLL_S):
            if not proc.is_alive():
                raise _died(proc)
            continue
        try:
            ok, value = conn.recv()
        except EOFError:  # the worker is gone: after its last task (the end), or killed
            thread.join(5)
            if sent.done and i >= sent.tasks:
                continue
            proc.join(1)
            raise _died(proc) from None
        if not ok:
            raise value
        yield value
        i += 1


def _died(proc) -> RuntimeError:
    return RuntimeError(
        f"a tokenizer worker died (exit code {proc.exitcode}); run the same prepare command again to resume"
    )
