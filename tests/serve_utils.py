"""A running ``gpt2lab serve`` app for tests: uvicorn in a thread, on a free port."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest


@contextmanager
def running_server(models: list[str], limits=None, deterministic: bool = False, linear: str = "packed") -> Iterator[str]:
    """Load ``models`` ([NAME=]MODEL, as on the command line) on CPU, serve them; yield the base URL.
    ``limits`` (serve.limits.Limits), ``deterministic`` and ``linear`` (--cpu-linear) are the serve
    flags of those names; the batching tests run the packed kernel, what ``auto`` picks on most CPUs."""
    pytest.importorskip("uvicorn", reason="gpt2lab serve needs the serve extra (fastapi, uvicorn)")
    from gpt2lab.serve.models import load_workers
    from gpt2lab.serve.api import serving_in_thread

    with serving_in_thread(load_workers(models, "cpu", "float32", limits, deterministic, linear)) as url:
        yield url
