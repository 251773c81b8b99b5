"""What reads the topic besides ``rankscope aggregate``: ``rankscope serve --kafka``, and the ingest
benchmark at the hooks' defaults."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import pytest

from rankscope.aggregator import Store
from tests.kafka.common import settings
from tests.kafka_broker import KafkaBroker, produce

pytestmark = pytest.mark.kafka


def test_serve_consumes_the_topic_and_opens_the_ticket(broker: KafkaBroker, tmp_path: Path) -> None:
    """``rankscope serve --kafka``: a recorded real run (rank 2 computes slower) arrives by Kafka."""
    from rankscope.api import ServeSettings, Service

    fixture = Path(__file__).parents[1] / "fixtures" / "compute-r2"
    items = []
    for gz in sorted(fixture.glob("*.jsonl.gz")):
        key = f"compute-r2/{gz.name.split('rank')[1].split('.')[0]}".encode()
        items += [(key, line) for line in gzip.decompress(gz.read_bytes()).splitlines()]
    assert items, f"no recorded run under {fixture}"
    produce(broker, "serve", items)
    with Store.embedded(tmp_path / "db") as store:
        svc = Service(
            store, ServeSettings(kafka=settings(broker, "serve"), interval_s=0.5, ended_after_s=1e9)
        )
        svc.start()
        try:
            deadline = time.monotonic() + 60
            while not svc.tickets and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            svc.stop()
        assert svc.aggregator is not None and svc.aggregator.stats.consumed == len(items)
        assert [(t.job, t.cause, t.ranks, t.state) for t in svc.tickets.values()] == [
            ("compute-r2", "compute", [2], "open")
        ]
        assert store.counts("compute-r2")["ranks"] == 4


def test_the_ingest_benchmark_stores_every_record_the_hooks_ship_at_their_defaults(
    broker: KafkaBroker, tmp_path: Path
) -> None:
    """``benchmarks.scale.ingest --ranks``: the records of ranks' hooks at their defaults, through Kafka."""
    from benchmarks.scale import ingest

    out = tmp_path / "ingest.json"
    argv = ["--ranks", "8", "--minutes", "1", "--functions", "20", "--kafka", broker.bootstrap]
    assert ingest.main([*argv, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    # Per rank: its rank record, a step record every 2 s, a heartbeat every 5 s, a window every 30 s.
    assert r["records"] == 8 * (1 + 30 + 12 + 2) and r["records_per_s"] > 0, r
