"""The server's Prometheus metrics, in a registry of its own (one per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from diffar.serving.engine import BatchStats


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("diffar_requests", "HTTP requests", ["path", "status"], registry=self.registry)
        self.errors = Counter("diffar_errors", "HTTP responses with status >= 400", ["path", "status"],
                              registry=self.registry)
        self.latency = Histogram("diffar_request_latency_seconds", "time to response (headers, for streams)",
                                 ["path"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                                 registry=self.registry)
        self.batch_size = Histogram("diffar_batch_size", "requests decoded together",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry)
        self.tokens = Counter("diffar_generated_tokens", "tokens generated", registry=self.registry)
        self.tokens_per_s = Gauge("diffar_tokens_per_second", "tokens/s of the last batch", registry=self.registry)
        self.queued = Gauge("diffar_queue_depth", "requests waiting for a batch", registry=self.registry)
        self.cancelled = Counter("diffar_cancelled", "generations cut short by a client that went away",
                                 registry=self.registry)
        self.generation = Histogram("diffar_generation_seconds", "submit to last token (streams included)",
                                    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
                                    registry=self.registry)

    def observe_batch(self, stats: BatchStats) -> None:
        self.batch_size.observe(stats.size)
        self.cancelled.inc(stats.cancelled)
        self.tokens.inc(stats.new_tokens)
        self.tokens_per_s.set(stats.new_tokens / stats.seconds if stats.seconds > 0 else 0.0)
