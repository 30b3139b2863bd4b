"""The ordered parallel map prepare tokenizes with: threads below the measured crossover, processes
above it; results in the documents' order from either pool; a task's error raised in its place."""

from __future__ import annotations

from typing import List

import pytest

from gpt2lab.data import parallel
from gpt2lab.data.parallel import THREAD_POOL_MAX_BYTES, ordered_map, task_chars, use_threads


def test_prepare_pool_crossover_scales_with_workers():
    assert THREAD_POOL_MAX_BYTES == 8 << 20  # the 2-worker crossover measured in docs/benchmarks.md
    assert use_threads((8 << 20) - 1, 2) and not use_threads(8 << 20, 2)
    four = (8 << 20) * 0.5 / 0.75  # W > S / (f (1 - 1/w)): 1 - 1/4 = 0.75 against 0.5 at 2 workers
    assert use_threads(int(four) - 1, 4) and not use_threads(int(four) + 1, 4)
    assert use_threads(10**12, 1)  # one worker: no pool to pay for
    assert not use_threads(None, 2)  # unknown size (the hub)


def test_a_task_is_an_eighth_of_a_workers_share_within_bounds():
    assert task_chars(8 * 2 * 100_000, 2) == 100_000
    assert task_chars(1000, 2) == parallel.TASK_CHARS_MIN  # a small source: no task under 64 KiB
    assert task_chars(1 << 40, 2) == parallel.TASK_CHARS_MAX  # a large one: none over 1 MiB
    assert task_chars(None, 2) == task_chars(0, 2) == parallel.TASK_CHARS_MAX  # size unknown: the largest


def _lengths(docs: List[str]) -> List[int]:
    return [len(d) for d in docs]


def _fails_on_seven(docs: List[str]) -> List[int]:
    if "doc 7" in docs:
        raise ValueError("doc 7 is bad")
    return _lengths(docs)


POOLS = [
    pytest.param(1, 1 << 40, id="one-worker"),
    pytest.param(2, 1 << 40, id="threads"),
    pytest.param(2, 0, id="processes"),
]


@pytest.mark.parametrize("workers, crossover", POOLS)
def test_results_come_in_the_documents_order(monkeypatch, workers, crossover):
    monkeypatch.setattr(parallel, "THREAD_POOL_MAX_BYTES", crossover)
    monkeypatch.setattr(parallel, "TASK_DOCS", 3)  # many small tasks, so the pool really interleaves
    docs = [f"doc {i}" + "x" * (i * 37 % 11) for i in range(50)]
    with ordered_map(_lengths, iter(docs), workers, 1000) as results:
        out = list(results)
    assert [len(task) for task in out] == [3] * 16 + [2]
    assert [n for task in out for n in task] == [len(d) for d in docs]


@pytest.mark.parametrize("workers, crossover", POOLS)
def test_a_tasks_error_is_raised_after_the_results_before_it(monkeypatch, workers, crossover):
    monkeypatch.setattr(parallel, "THREAD_POOL_MAX_BYTES", crossover)
    monkeypatch.setattr(parallel, "TASK_DOCS", 2)
    docs = [f"doc {i}" for i in range(20)]
    got = []
    with pytest.raises(ValueError, match="doc 7 is bad"):
        with ordered_map(_fails_on_seven, iter(docs), workers, 1000) as results:
            for task in results:
                got.append(task)
    assert got == [[5, 5], [5, 5], [5, 5]]  # tasks 0-2 (docs 0-5); task 3 holds doc 7
