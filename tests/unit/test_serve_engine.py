"""The worker's rules in both modes (serve/batch.py, inference/completion.py): a stop string's possible start
is held back until it is known (the incremental matcher against a brute-force reading of the whole text), and
a waiting request whose client left gives its queue place back at once, once."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_gpt

from gpt2lab.inference.completion import StopFilter, StopString
from gpt2lab.serve.batch import Worker
from gpt2lab.serve.jobs import Job, QueueFull
from gpt2lab.serve.limits import Limits


def test_stop_filter_holds_back_a_possible_start():
    f = StopFilter(["END"])
    assert f.feed("abcE") == ("abc", False)  # "E" may begin "END"
    assert f.feed("N") == ("", False)
    assert f.feed("Dxyz") == ("", True)
    g = StopFilter(["END"])
    assert g.feed("xE") == ("x", False) and g.feed("Q") == ("EQ", False) and g.flush() == ""


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """The whole text read at once: cut before the first stop string to end (the longest of those ending
    at the same character), else all of it."""
    for end in range(1, len(text) + 1):
        ended = [len(s) for s in stops if s and text[:end].endswith(s)]
        if ended:
            return text[: end - max(ended)], True
    return text, False


def _held(text: str, stops: list[str]) -> int:
    """The longest end of ``text`` that begins a stop string (and is not one)."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def test_stop_filter_agrees_with_the_whole_text_read_at_once_on_random_strings():
    """Random texts in random pieces (empty ones too) against random stop strings over two or three
    letters (overlapping prefixes: "aab" in "aaab"; several stops; hits across pieces): what is emitted
    is the brute-force cut, and after each piece exactly the text that cannot begin a stop string."""
    rng = random.Random(0)
    for trial in range(4000):
        letters = "ab" if trial % 2 else "abc"
        word = lambda n: "".join(rng.choice(letters) for _ in range(n))  # noqa: E731
        stops = [word(rng.randint(0, 6)) for _ in range(rng.randint(1, 4))]
        text = word(rng.randint(0, 30))
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, 8)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        shared = [StopString(s) for s in stops]  # as a request's choices share them
        f = StopFilter(shared if trial % 3 else stops)
        out, fed, hit = "", "", False
        for piece in pieces:
            fed += piece
            emitted, hit = f.feed(piece)
            out += emitted
            if hit:
                break
            assert out == fed[: len(fed) - _held(fed, stops)], (stops, pieces)
        out += "" if hit else f.flush()
        assert (out, hit) == _cut(text, stops), (stops, pieces)


def test_a_long_stop_string_costs_what_the_text_matched_of_it():
    """500,000 characters: a text that never begins it and one that matches 4,000 characters of it are fed
    in 1,000 pieces; the matcher's table holds only what was matched (its cost, not the string's length)."""
    stop = StopString("ab" * 250_000)
    f = StopFilter([stop])
    assert all(f.feed("xyz ") == ("xyz ", False) for _ in range(1000)) and len(stop.border) == 1
    g = StopFilter([stop])
    assert all(g.feed("abab") == ("", False) for _ in range(1000)) and len(stop.border) == 4000
    assert g.feed("abX") == ("ab" * 2001 + "X", False)  # held back until it could no longer begin the stop


def test_a_waiting_client_that_hangs_up_gives_its_queue_place_back_at_once():
    """Its place is free when the handler sees the hang-up, not only at the worker's next step (a
    busy or descheduled worker thread let a request right after it find the queue full: 429)."""
    import asyncio

    from gpt2lab.inference.completion import Sampling

    worker = Worker("m", tiny_gpt(), torch.device("cpu"), Limits(max_batch=1, max_queue=2))  # no engine runs it
    loop = asyncio.new_event_loop()
    try:
        job = lambda: Job([[1]], Sampling(max_new_tokens=4), seeds=[0])  # noqa: E731
        first, second = job(), job()
        worker.submit(first, loop)
        worker.submit(second, loop)
        with pytest.raises(QueueFull, match="--max-queue 2"):
            worker.submit(job(), loop)
        first.cancel()
        assert first.cancelled and worker.queue_depth() == 1
        worker.submit(third := job(), loop)  # taken at once: the worker has not stepped
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
