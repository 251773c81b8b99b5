"""The aggregator's Prometheus metrics, in a registry of its own (so tests can run several).

Served at ``http://<host>:<port>/metrics`` by ``rankscope aggregate --metrics-port PORT``.

Example::

    metrics = Metrics()
    metrics.serve(9108)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rankscope.wire.errors import UnavailableError

_PREFIX = "rankscope_aggregator"


class Metrics:
    """Counters of what one aggregator consumed, stored and dead-lettered; batch latency; lag."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.consumed = Counter(f"{_PREFIX}_consumed", "Kafka messages consumed", registry=r)
        self.stored = Counter(f"{_PREFIX}_stored", "Records written to ClickHouse", registry=r)
        self.dead_letters = Counter(
            f"{_PREFIX}_dead_letters", "Messages kept in the dead-letter table, with the reason", registry=r
        )
        self.insert_failures = Counter(
            f"{_PREFIX}_insert_failures", "Batch inserts that failed and were retried", registry=r
        )
        self.commits = Counter(f"{_PREFIX}_commits", "Offset commits after a stored batch", registry=r)
        self.commit_failures = Counter(
            f"{_PREFIX}_commit_failures",
            "Offset commits refused (e.g. after a rebalance); their messages are redelivered",
            registry=r,
        )
        self.batch_seconds = Histogram(
            f"{_PREFIX}_batch_seconds",
            "Time to store one batch and commit its offsets, retries included",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.batch_records = Histogram(
            f"{_PREFIX}_batch_records",
            "Messages per stored batch",
            buckets=(1, 10, 100, 500, 1000, 2000, 5000, 10000, 50000),
            registry=r,
        )
        self.lag = Gauge(
            f"{_PREFIX}_lag",
            "Messages on the partition not yet consumed (high watermark minus position)",
            ("topic", "partition"),
            registry=r,
        )

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` over HTTP on a daemon thread; UnavailableError if the port cannot be had."""
        try:
            start_http_server(port, addr=addr, registry=self.registry)
        except (OSError, OverflowError) as exc:  # in use, privileged, or not a port number
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise UnavailableError(f"cannot serve metrics on {addr}:{port}: {why}") from None

    def value(self, name: str, **labels: str) -> float:
        """The current value of one sample, e.g. ``value("stored_total")`` (0 if never set)."""
        v = self.registry.get_sample_value(f"{_PREFIX}_{name}", labels or None)
        return 0.0 if v is None else v
