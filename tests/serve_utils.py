"""A running ``gpt2lab serve`` app for tests: uvicorn in a thread, on a free port."""
from __future__ import annotations

import time
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
    from gpt2lab.inference.choice import InferenceRequest
    from gpt2lab.serve.models import load_workers
    from gpt2lab.serve.api import serving_in_thread

    request = InferenceRequest(dtype=dtype, quantize=quantize, linear=linear)
    with serving_in_thread(load_workers(models, "cpu", request, limits, deterministic)) as url:
        yield url


def scrape(url: str) -> dict:
    """/metrics parsed by prometheus_client's own parser: {(name, labels...): value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, *sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


def wait_until_idle(url: str, model: str, timeout: float = 30) -> dict:
    """Poll /metrics until ``model`` has no request waiting and no row generating; the last scrape.
    A client's hang-up reaches the server asynchronously: this is how a test knows it has."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        busy = m[("gpt2lab_queue_depth", ("model", model))], m[("gpt2lab_active_rows", ("model", model))]
        if busy == (0, 0) or time.monotonic() > deadline:
            assert busy == (0, 0), f"after {timeout:g} s model {model!r} still has (waiting, rows) {busy}"
            return m
        time.sleep(0.02)
