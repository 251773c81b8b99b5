"""What the Kafka tests share: the aggregator in process and as ``rankscope aggregate``, a hook
that ships to the broker, and its steps timed where waiting on a broker would show."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rankscope.aggregator import Store
from rankscope.aggregator.consumer import AggregateStats, Aggregator, BatchSettings, KafkaSettings
from rankscope.profiler_hook.config import Config, Identity
from rankscope.profiler_hook.gcpause import GcClock
from rankscope.profiler_hook.hook import Hook
from rankscope.wire.records import Record, decode
from tests.kafka_broker import FAST_GROUP, KafkaBroker

MAX_STEP_S = 0.25
"""No training step may spend longer than this in the hook (where waiting on a broker would show).

A step that waited on the broker would wait at least the producer's ``max_block_ms`` (1 s) or the
outage itself (seconds). The bound sits well under both, and above what a busy 2-core CI runner adds
to a step that waits on nothing: with a Java broker, an aggregator starting up and the shipper's
thread sharing two cores, one step in the broker-up phase measured 149 ms of pure scheduling delay.
"""


def settings(broker: KafkaBroker, topic: str, group: str = "agg") -> KafkaSettings:
    return KafkaSettings(
        bootstrap=broker.bootstrap, topic=topic, group=group, api_version="0.9", options=FAST_GROUP
    )


def aggregate(store: Store, kafka: KafkaSettings, idle_s: float = 4.0, **batching: Any) -> AggregateStats:
    """Run one aggregator until the topic has been quiet for ``idle_s``."""
    return Aggregator(store, kafka, BatchSettings(**batching)).run(idle_exit_s=idle_s)


def aggregate_cli(
    broker: KafkaBroker,
    topic: str,
    store: Path,
    module: str = "rankscope.cli",
    idle_s: float = 4.0,
    wait: bool = True,
) -> Any:
    """``rankscope aggregate`` in a process of its own: its CompletedProcess, or with ``wait=False`` its
    Popen, logging its progress (``-v``) to ``<store>.log``."""
    argv = [sys.executable, "-m", module, "aggregate", "--kafka", broker.bootstrap, "--topic", topic]
    argv += ["--kafka-api-version", "0.9", "--store", str(store), "--exit-when-idle", str(idle_s)]
    argv += [f"--kafka-option={k}={v}" for k, v in FAST_GROUP.items()]
    if not wait:
        with store.with_suffix(".log").open("w") as log:
            return subprocess.Popen([*argv[:3], "-v", *argv[3:]], stdout=log, stderr=log, text=True)
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def distinct_records(values: Iterable[bytes]) -> list[Record]:
    """The topic's records with redelivered copies (same bytes) removed."""
    return [decode(v) for v in dict.fromkeys(values)]


def hook_steps(hook: Hook, seconds: float) -> float:
    """Run training-like steps for ``seconds``; returns the longest time a step spent in the hook.

    Only the hook's part of the step (begin + end) is timed, which is where waiting on a broker would
    show, less any garbage collection that happened to run there (it would run in any training
    step); the 2 ms of "training" in between would only add the machine's scheduling noise.
    """
    clock = GcClock()  # the hook's own collection clock
    clock.install()
    worst = 0.0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            gc0, t0 = clock.total_ns, time.perf_counter_ns()
            hook.begin_step()
            gc1, t1 = clock.total_ns, time.perf_counter_ns()
            time.sleep(0.002)
            gc2, t2 = clock.total_ns, time.perf_counter_ns()
            hook.end_step()
            gc3, t3 = clock.total_ns, time.perf_counter_ns()
            in_hook = ((t1 - t0) - (gc1 - gc0) + (t3 - t2) - (gc3 - gc2)) / 1e9
            worst = max(worst, in_hook)
    finally:
        clock.uninstall()
    return worst


def kafka_hook(broker: KafkaBroker, topic: str, job: str, **cfg: Any) -> Hook:
    config = Config(
        job=job,
        sink="kafka",
        kafka_bootstrap=broker.bootstrap,
        kafka_api_version="0.9",
        kafka_topic=topic,
        flush_s=0.05,
        step_block_s=0,  # a row a step, shipped every 50 ms: many small records
        heartbeat_s=0.5,
        window_s=0,
        **cfg,
    )
    return Hook(config, Identity(rank=0, local_rank=0, world_size=1, host="h"))


def step_until_logged(hook: Hook, log: Path, text: str, timeout: float = 60.0) -> float:
    """Step until ``log`` says ``text``; returns the longest step."""
    worst, deadline = 0.0, time.monotonic() + timeout
    while not (log.exists() and text in log.read_text()):
        assert time.monotonic() < deadline, f"{log} never said {text!r}:\n{log.read_text()[-3000:]}"
        worst = max(worst, hook_steps(hook, 0.5))
    return worst


def drain(hook: Hook, timeout: float = 30.0) -> float:
    """Step until the hook's queue is empty and its producer has delivered; returns the longest step."""
    worst = 0.0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (hook.shipper.sink.delivered and hook.shipper.idle()):  # type: ignore[attr-defined]
        worst = max(worst, hook_steps(hook, 0.5))  # the producer reconnects with backoff
    return worst
