"""A running ``gpt2lab serve`` app for tests: uvicorn in a thread, on a free port."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest


@contextmanager
def running_server(models: list[str], limits=None, deterministic: bool = False, linear: str = "packed",
                   dtype: str = "float32", quantize: str = "none") -> Iterator[str]:
    """Load ``models`` ([NAME=]MODEL, as on the command line) on CPU, serve them; yield the base URL.
    ``limits`` (serve.limits.Limits), ``deterministic``, ``linear`` (--cpu-linear), ``dtype`` and
    ``quantize`` are the serve flags of those names; the tests run fp32 packed linears (one candidate:
    nothing is measured), what ``auto`` picks for fp32 on most CPUs."""
    pytest.importorskip("uvicorn", reason="gpt2lab serve needs the serve extra (fastapi, uvicorn)")
    from gpt2lab.inference.prepare import InferenceRequest
    from gpt2lab.serve.models import load_workers
    from gpt2lab.serve.api import serving_in_thread

    request = InferenceRequest(dtype=dtype, quantize=quantize, linear=linear)
    with serving_in_thread(load_workers(models, "cpu", request, limits, deterministic)) as url:
        yield url
