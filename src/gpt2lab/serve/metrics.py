"""``/metrics``: the server's counters and histograms in Prometheus' text format (prometheus_client).

One ``ServeMetrics`` per app, each in its own registry (tests run several apps in one
process). Workers report tokens, first-token and per-token latency, and batch sizes; the
access-log middleware reports requests by path and status; the connection guard
(serve/connections.py) the connections it closed before a request; queue depth, active rows and
open connections are read when scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: from a fast GPU step to a long CPU wait in a full queue
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        per_model = {"labelnames": ["model"], "registry": r}
        latency = {**per_model, "buckets": LATENCY_BUCKETS}
        self.requests = Counter(
            "gpt2lab_requests", "HTTP requests answered, by path and status code", ["path", "status"], registry=r
        )
        self.tokens = Counter("gpt2lab_generated_tokens", "Completion tokens sampled", **per_model)
        self.queue_depth = Gauge("gpt2lab_queue_depth", "Requests accepted and waiting for a batch row", **per_model)
        self.active_rows = Gauge("gpt2lab_active_rows", "Rows (prompt x sample streams) being generated", **per_model)
        self.batch_size = Histogram(
            "gpt2lab_batch_size", "Rows in each decode step", buckets=BATCH_BUCKETS, **per_model
        )
        self.first_token = Histogram(
            "gpt2lab_time_to_first_token_seconds", "From a request's arrival to its first sampled token", **latency
        )
        self.per_token = Histogram(
            "gpt2lab_time_per_output_token_seconds", "Between consecutive sampled tokens of one stream", **latency
        )
        self.connections = Gauge("gpt2lab_open_connections", "HTTP connections open", registry=r)
        self.dropped = Counter(
            "gpt2lab_connections_dropped",
            "Connections closed before a request: past --max-connections (max_connections) or without a "
            "whole request head within --header-timeout (header_timeout)",
            ["reason"],
            registry=r,
        )

    def watch(self, worker) -> None:
        """Take ``worker``'s counts, and read its queue depth and active rows at each scrape."""
        worker.metrics = self
        self.queue_depth.labels(worker.name).set_function(worker.queue_depth)
        self.active_rows.labels(worker.name).set_function(worker.active_rows)

    def text(self) -> bytes:
        return generate_latest(self.registry)
