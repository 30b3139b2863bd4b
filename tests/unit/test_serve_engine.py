"""What both workers share (serve/engine.py): a stop string's possible start is held back until it is
known, and a waiting request whose client left gives its queue place back at once, once."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_gpt

from gpt2lab.serve.engine import Job, QueueFull, StopFilter, Work, Worker
from gpt2lab.serve.limits import Limits


def test_stop_filter_holds_back_a_possible_start():
    f = StopFilter(["END"])
    assert f.feed("abcE") == ("abc", False)  # "E" may begin "END"
    assert f.feed("N") == ("", False)
    assert f.feed("Dxyz") == ("", True)
    g = StopFilter(["END"])
    assert g.feed("xE") == ("x", False) and g.feed("Q") == ("EQ", False) and g.flush() == ""


def test_a_waiting_client_that_hangs_up_gives_its_queue_place_back_at_once():
    """Its place is free when the handler sees the hang-up, not only at the worker's next step (a
    busy or descheduled worker thread let a request right after it find the queue full: 429)."""
    import asyncio

    from gpt2lab.inference.completion import Sampling

    worker = Worker("m", tiny_gpt(), torch.device("cpu"), Limits(max_batch=1, max_queue=2))  # no engine runs it
    loop = asyncio.new_event_loop()
    try:
        work = Work([[1]], Sampling(max_new_tokens=4), n=1, seeds=[0], stops=[], echo=[])
        first, second = Job(work, loop, 60), Job(work, loop, 60)
        worker.submit(first)
        worker.submit(second)
        with pytest.raises(QueueFull, match="--max-queue 2"):
            worker.submit(Job(work, loop, 60))
        first.cancel()
        assert first.cancelled and worker.queue_depth() == 1
        worker.submit(third := Job(work, loop, 60))  # taken at once: the worker has not stepped
        assert worker.queue_depth() == 2
        first.cancel()  # a second call (the handler's finally after an error) and the worker's own
        worker._started(first)  # drop of the cancelled job give nothing back twice
        assert worker.queue_depth() == 2
        worker._started(third)  # started: its place goes back once, and its later cancel is a no-op
        third.cancel()
        assert worker.queue_depth() == 1
    finally:
        worker.close()
        loop.close()
