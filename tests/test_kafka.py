"""The Kafka transport end to end against a real broker (Apache Kafka 0.9.0.1, tests/kafka_broker.py).

hook (KafkaSink) → topic → ``rankscope aggregate`` (aggregator.consumer) → chDB store. Every test
checks the same invariant: the records in the store (read with FINAL) are exactly the distinct
records on the topic, which are exactly as many as the hook reports as sent.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import kafka.record.default_records
import kafka.record.legacy_records
import pytest
from kafka import KafkaConsumer
from kafka.codec import gzip_encode
from kafka.errors import KafkaConnectionError

from benchmarks.workload import JobSpec, free_port, launch
from rankscope.aggregator import Store, StoreError
from rankscope.aggregator.consumer import (
    AggregateStats,
    Aggregator,
    BatchSettings,
    KafkaSettings,
    use_isal_gzip,
)
from rankscope.aggregator.metrics import Metrics
from rankscope.profiler_hook.config import Config, Identity
from rankscope.profiler_hook.gcpause import GcClock
from rankscope.profiler_hook.hook import Hook
from rankscope.wire.records import (
    MAX_VALUE_BYTES,
    Heartbeat,
    Record,
    WindowSummary,
    decode,
    encode,
)
from tests.kafka_broker import FAST_GROUP, KafkaBroker, produce, read_topic
from tests.records import assert_stored_once, expected_counts, synthetic_records

pytestmark = pytest.mark.kafka
MAX_STEP_S = 0.25
"""No training step may spend longer than this in the hook (where waiting on a broker would show).

A step that waited on the broker would wait at least the producer's ``max_block_ms`` (1 s) or the
outage itself (seconds). The bound sits well under both, and above what a busy 2-core CI runner adds
to a step that waits on nothing: with a Java broker, an aggregator starting up and the shipper's
thread sharing two cores, one step in the broker-up phase measured 149 ms of pure scheduling delay.
"""
# --- helpers --------------------------------------------------------------------------------------


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


def _step_until_logged(hook: Hook, log: Path, text: str, timeout: float = 60.0) -> float:
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


# --- the whole pipeline -----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_hooked_multi_rank_job_is_stored_exactly_once_by_rankscope_aggregate(
    broker: KafkaBroker, tmp_path: Path
) -> None:
    hook = {
        "sink": "kafka",
        "kafka_bootstrap": broker.bootstrap,
        "kafka_api_version": "0.9",
        "kafka_topic": "ranks",
        "window_s": 0.5,
        "window_budget": 1.0,  # windows every 0.5 s, whatever they cost: records of every kind
        "flush_s": 0.5,
    }
    stats = launch(
        JobSpec(
            # By time, not steps: the first two windows come 10 and 20 s after start-up, and 300
            # steps on an idle machine ended before the second.
            job="kj", world_size=2, hosts=1, port=free_port(), seconds=23, hook=hook,
            log_dir=str(tmp_path / "logs"), progress=False,
        )
    )  # fmt: skip
    sent = sum(s["sent"] for s in stats)
    assert sum(s["dropped"] for s in stats) == 0
    done = aggregate_cli(broker, "ranks", tmp_path / "db")
    assert done.returncode == 0, done.stderr
    assert f"stored {sent} records and 0 dead letters" in done.stdout
    records = distinct_records(read_topic(broker.bootstrap, "ranks", sent))
    assert len(records) == sent
    with Store.embedded(tmp_path / "db") as store:
        assert_stored_once(store, "kj", records)
        by_rank = store.windows("kj").groupby("rank")["window"].apply(set)
        # Both ranks profiled the same windows (a rank that reads a plan after its step has passed
        # skips that one: profiler_hook.schedule; under CI load it happened once in this 0.5 s schedule).
        assert len(by_rank) == 2 and len(by_rank[0] & by_rank[1]) >= 2
        # The ranks talk over loopback, which never touches a NIC: no send-rate pattern.
        fns = store.functions("kj")
        assert not (fns["name"] == "net_send@tcp").any()
        steps = store.steps("kj")
        assert sorted(zip(steps["rank"], steps["step"], strict=True)) == [
            (r, s) for r in (0, 1) for s in range(stats[0]["steps"])
        ]


def test_a_broker_that_comes_up_late_never_blocks_a_step(broker_home: Path, tmp_path: Path) -> None:
    late = KafkaBroker(broker_home, tmp_path / "kafka")  # its port is chosen; nothing listens yet
    hook = kafka_hook(late, "late", "late", queue_size=50)
    try:
        worst = hook_steps(hook, 3.0)  # no broker: the queue fills, the rest is dropped and counted
        assert hook.shipper.dropped > 0
        late.start()
        worst = max(worst, drain(hook), hook_steps(hook, 1.5))  # heartbeats flow again, with the drops
        hook.close(timeout=30)
        with Store.embedded(tmp_path / "db") as store:
            stats = aggregate(store, settings(late, "late"))
            records = distinct_records(read_topic(late.bootstrap, "late", hook.shipper.sent))
            assert len(records) == hook.shipper.sent == stats.stored > 0
            # The records dropped while no broker listened are the gaps in the numbers.
            assert_stored_once(store, "late", records, dropped=hook.shipper.dropped)
            # The last heartbeat (sent once the broker was back) reports the drops.
            assert store.heartbeats_latest("late")["dropped"].iloc[0] > 0
    finally:
        late.stop()
    assert worst < MAX_STEP_S, f"a step waited {worst * 1e3:.1f} ms"


def test_a_broker_killed_and_restarted_mid_run_loses_nothing_and_blocks_no_step(
    broker: KafkaBroker, tmp_path: Path
) -> None:
    hook = kafka_hook(broker, "restart", "restart", queue_size=5000)
    # The aggregator runs beside the job in its own process, as in production. The outage (12 s
    # of steps plus the broker's restart) is longer than its idle time: quiet while the broker is
    # away is not idle, so it must wait the outage out and store what comes after. Idle is 10 s:
    # once the restarted broker answers, its partitions can take seconds more to take records
    # (its ListOffsets say "unknown topic or partition"; the group coordinator moves), and the
    # hook's producer delivers what it held only then. With 5 s, a CI run's aggregator read the
    # topic drained and stopped before the records held through the outage arrived (102 of 193).
    aggregator = aggregate_cli(broker, "restart", tmp_path / "db", idle_s=10, wait=False)
    worst = {}
    try:
        # Consuming beside the job before the broker goes: one that first connects to the
        # restarted broker reads it drained while the hook's producer still reconnects (a CI run:
        # it started, read the 42 records of before and stopped 6 s later).
        worst["starting"] = _step_until_logged(hook, tmp_path / "db.log", "partitions assigned")
        worst["before"] = hook_steps(hook, 2.0)
        broker.stop_broker()  # SIGKILL, as a crash
        worst["broker down"] = hook_steps(hook, 12.0)
        broker.start_broker()
        worst["broker back"] = max(drain(hook), hook_steps(hook, 1.0))
        hook.close(timeout=30)
        aggregator.wait(timeout=120)
    finally:
        aggregator.kill()
    err = (tmp_path / "db.log").read_text()
    assert aggregator.returncode == 0, err
    # It waited the outage out; but the hook's producer can deliver what it held seconds after the
    # broker answers again, after an aggregator that exits when idle found the topic read and
    # stopped (a CI run: it stored 93 of 372 arrivals, and the rest reached the topic later). The
    # next run resumes from the group's committed offsets, as a restarted aggregator does.
    again = aggregate_cli(broker, "restart", tmp_path / "db", idle_s=3)
    assert again.returncode == 0, again.stderr[-3000:]
    assert hook.shipper.dropped == 0  # the queue held everything while the broker was away
    records = distinct_records(read_topic(broker.bootstrap, "restart", hook.shipper.sent))
    assert len(records) == hook.shipper.sent > 0
    with Store.embedded(tmp_path / "db") as store:
        try:
            assert_stored_once(store, "restart", records)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nthe aggregator's log:\n{err[-6000:]}") from exc
    assert max(worst.values()) < MAX_STEP_S, f"longest step per phase (s): {worst}"


def test_an_aggregator_killed_between_insert_and_commit_stores_nothing_twice(
    broker: KafkaBroker, tmp_path: Path
) -> None:
    records = synthetic_records("crash")
    produce(broker, "crash", (encode(r) for r in records))
    db = tmp_path / "db"
    # The first aggregator dies (os._exit) right after its first insert, before committing offsets.
    first = aggregate_cli(broker, "crash", db, module="tests.crashing_aggregator")
    assert first.returncode == 9, first.stderr
    with Store.embedded(db) as store:
        inserted = store.counts("crash")
    assert inserted["ranks"] > 0  # the insert happened
    second = aggregate_cli(broker, "crash", db)
    assert second.returncode == 0, second.stderr
    # Nothing was committed, so the restarted aggregator got every message again…
    assert f"consumed {len(records)} messages" in second.stdout
    with Store.embedded(db) as store:
        assert_stored_once(store, "crash", records)  # …and the replay added no duplicates.
        assert store.dead_letters().empty


def test_a_failing_insert_is_retried_and_nothing_is_committed_before_it_succeeds(
    broker: KafkaBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = synthetic_records("flaky")
    produce(broker, "flaky", (encode(r) for r in records))
    with Store.embedded(tmp_path / "db") as store:
        write = store.write_batch
        failures = 0

        def flaky(batch: Any) -> int:
            nonlocal failures
            if failures < 2:
                failures += 1
                raise StoreError("insert failed: connection refused (simulated database outage)")
            return write(batch)

        monkeypatch.setattr(store, "write_batch", flaky)
        # Start from the standard library's decoder: the aggregator puts ISA-L in place itself.
        monkeypatch.setattr(kafka.record.default_records, "gzip_decode", gzip.decompress)
        metrics = Metrics()
        agg = Aggregator(store, settings(broker, "flaky"), BatchSettings(retry_s=0.1, writers=1), metrics)
        stats = agg.run(idle_exit_s=4)
        assert kafka.record.default_records.gzip_decode.__module__.startswith("isal")
        assert stats.insert_failures == metrics.value("insert_failures_total") == 2
        assert stats.stored == len(records)
        assert_stored_once(store, "flaky", records)
        # A second member of the group finds everything committed: it gets nothing.
        again = aggregate(store, settings(broker, "flaky"), idle_s=3)
        assert again.consumed == 0


def test_a_commit_lost_to_an_outage_is_made_again_before_an_idle_aggregator_stops(
    broker: KafkaBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = synthetic_records("lostcommit", ranks=2, batches=3)
    produce(broker, "lostcommit", (encode(r) for r in records))
    commit, lost = KafkaConsumer.commit, []

    def commit_fails_once(self: KafkaConsumer, offsets: Any = None) -> Any:
        if not lost:
            lost.append(offsets)
            raise KafkaConnectionError("connection reset (simulated broker outage)")
        return commit(self, offsets)

    monkeypatch.setattr(KafkaConsumer, "commit", commit_fails_once)
    with Store.embedded(tmp_path / "db") as store:
        # One batch: its commit is the one lost. The topic stays quiet, so only the idle check can
        # make it again; without that, this member would leave its stored messages uncommitted.
        agg = Aggregator(store, settings(broker, "lostcommit"), BatchSettings(records=len(records) + 1))
        guard = threading.Timer(60, agg.stop)  # should it never find the topic drained
        guard.start()
        t0 = time.monotonic()
        stats = agg.run(idle_exit_s=2)
        guard.cancel()
        assert time.monotonic() - t0 < 60, "the aggregator never found its own messages committed"
        assert lost and stats.stored == len(records)
        assert_stored_once(store, "lostcommit", records)
        again = aggregate(store, settings(broker, "lostcommit"), idle_s=2)
        assert again.consumed == 0  # the group's offsets cover the whole topic


def test_an_idle_aggregator_waits_while_the_broker_lists_not_all_partitions_after_a_restart(
    broker: KafkaBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = synthetic_records("leaderless", ranks=2, batches=3)
    early, late = records[: len(records) // 2], records[len(records) // 2 :]
    produce(broker, "leaderless", (encode(r) for r in early))
    partitions_for_topic, answers = KafkaConsumer.partitions_for_topic, []

    def leaderless_for_a_while(self: KafkaConsumer, topic: str) -> Any:
        # As right after a broker restart (seen in CI): the topic's metadata lists none of its
        # partitions, then some, until their leaders are elected; the producers send what they
        # held once the broker has them back. The idle check asks once a second.
        answers.append(topic)
        every = partitions_for_topic(self, topic)
        if len(answers) == 2:
            return set()
        if len(answers) in (3, 4, 5):  # quiet 3 s by the fifth: all it lists has been read
            return every - {min(every)}
        if len(answers) == 6:
            produce(broker, "leaderless", (encode(r) for r in late))
        return every

    monkeypatch.setattr(KafkaConsumer, "partitions_for_topic", leaderless_for_a_while)
    with Store.embedded(tmp_path / "db") as store:
        # Quiet 3 s: the first answer (the whole topic, drained) is seen before the broker's.
        stats = aggregate(store, settings(broker, "leaderless"), idle_s=3)
        assert len(answers) > 6  # it asked again instead of taking a partial list for drained
        assert stats.stored == len(records)
        assert_stored_once(store, "leaderless", records)


def test_malformed_messages_are_dead_lettered_with_the_reason_and_the_rest_is_stored(
    broker: KafkaBroker, tmp_path: Path
) -> None:
    good = synthetic_records("dl", ranks=1, batches=2)
    bad_step = json.loads(encode(good[1])[1])
    bad_step["rows"][0][1] = "yesterday"  # a string where an Int64 goes
    window = next(r for r in reversed(good) if isinstance(r, WindowSummary))
    bad_window = json.loads(encode(window)[1])
    bad_window["functions"][3][3] = "many"  # a call count
    no_job = json.loads(encode(window)[1])
    del no_job["job"]
    # What ClickHouse's JSON parser would have stored changed: a wrapped count, "7", NaN; and rank -1.
    wrapped, quoted, nan = (json.loads(encode(window)[1]) for _ in range(3))
    wrapped["functions"][0][3] = 99999999999999999999
    quoted["functions"][0][3] = "7"
    nan["functions"][0][9] = float("nan")
    heartbeat = json.loads(
        encode(Heartbeat(job="dl", rank=0, host="h", time_us=1, step=1, progress_age_s=1.0))[1]
    )
    oversized = json.dumps({"v": 1, "type": "heartbeat", "stack": "x" * MAX_VALUE_BYTES}).encode()
    bad: list[tuple[bytes | None, bytes | None]] = [
        (b"dl/0", b"\xff\xfenot json"),
        (b"dl/0", b'{"v": 99, "type": "steps"}'),
        (b"dl/0", b'{"v": 1, "type": "gossip"}'),
        (b"dl/0", json.dumps(bad_step).encode()),
        (b"dl/0", oversized),
        (b"dl/0", None),
        # Window summaries in the hook's encoding are parsed by ClickHouse; a bad one fails that
        # insert, and the batch is then checked record by record.
        (b"dl/0", json.dumps(bad_window, separators=(",", ":")).encode()),
        (b"dl/0", json.dumps(no_job, separators=(",", ":")).encode()),
        *((b"dl/0", json.dumps(d, separators=(",", ":")).encode()) for d in (wrapped, quoted, nan)),
        (b"dl/0", json.dumps({**heartbeat, "rank": -1}).encode()),
        (b"dl/0", json.dumps({**heartbeat, "progress_age_s": float("inf")}).encode()),
    ]
    # One partition keyed by one rank: good and bad messages interleave in a known order.
    produce(broker, "dl", [encode(good[0]), *bad[:3], *(encode(r) for r in good[1:]), *bad[3:]])
    metrics = Metrics()
    port = free_port()
    metrics.serve(port, addr="127.0.0.1")
    with Store.embedded(tmp_path / "db") as store:
        stats = Aggregator(store, settings(broker, "dl"), metrics=metrics).run(idle_exit_s=4)
        assert stats.dead_letters == len(bad)
        assert_stored_once(store, "dl", good)
        letters = store.dead_letters()
    reasons = dict(zip(letters["position"].astype(int), letters["reason"], strict=True))
    assert len(reasons) == len(bad)
    assert letters["source"].nunique() == 1 and letters["source"].iloc[0].startswith("kafka:dl/")
    by_order = [reasons[p] for p in sorted(reasons)]
    assert by_order[0].startswith("not JSON")
    assert "unknown schema version 99" in by_order[1]
    assert "unknown record type 'gossip'" in by_order[2]
    assert "rows[0].start_us must be int, got 'yesterday'" in by_order[3]
    assert f"exceeds the 1048576-byte limit (kept: its first 4096 of {len(oversized)} bytes)" in by_order[4]
    assert "not JSON" in by_order[5]  # an empty (null) value
    assert "functions[3].count must be int, got 'many'" in by_order[6]
    assert "window record lacks field 'job'" in by_order[7]
    assert "functions[0].count must be int in [" in by_order[8]
    assert "functions[0].count must be int, got '7'" in by_order[9]
    assert "NaN is not a JSON number" in by_order[10]
    assert "field 'rank' must be int in [0, 2147483648), got -1" in by_order[11]
    assert "Infinity is not a JSON number" in by_order[12]
    raw = letters.set_index(letters["position"].astype(int))["raw"]
    assert raw[min(reasons)] == "\\xff\\xfenot json"  # the raw bytes, invalid UTF-8 escaped
    assert raw[sorted(reasons)[4]] == oversized[:4096].decode()  # its start only
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert f"rankscope_aggregator_dead_letters_total {float(len(bad))}" in text
    assert f"rankscope_aggregator_stored_total {float(len(good))}" in text


def test_aggregators_in_one_group_share_the_partitions_as_members_join_and_leave(
    broker: KafkaBroker, tmp_path: Path
) -> None:
    """Two members of one group: the second joins while the first consumes (a rebalance), both get
    partitions; then one leaves while more records come, and the other takes its partitions. Every
    record of both spells is stored once: none lost, none twice."""
    records = synthetic_records("shared", ranks=16, batches=4)
    later = synthetic_records("shared-later", ranks=16, batches=4)
    produce(broker, "shared", (encode(r) for r in records))
    stops = [threading.Event(), threading.Event()]
    with Store.embedded(tmp_path / "db") as store:  # one process: the members share one chDB engine
        members = [
            Aggregator(store, settings(broker, "shared"), BatchSettings(records=20, seconds=0.2))
            for _ in range(2)
        ]
        threads = [
            threading.Thread(target=m.run, kwargs={"stop": stop})
            for m, stop in zip(members, stops, strict=True)
        ]
        seen: list[set[Any]] = [set(), set()]

        def until(done: Callable[[], bool]) -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not done():
                for s, m in zip(seen, members, strict=True):
                    s.update(m.assignment)
                time.sleep(0.3)

        for t in threads:
            t.start()
            time.sleep(1.0)  # the second joins while the first consumes: a rebalance
        until(lambda: store.counts("shared") == expected_counts(records) and all(seen))
        assert all(seen), f"a member never got a partition: {seen}"
        stops[1].set()  # the second leaves
        threads[1].join(60)
        produce(broker, "shared", (encode(r) for r in later))
        seen[0].clear()
        until(lambda: store.counts("shared-later") == expected_counts(later) and seen[0] >= seen[1])
        stops[0].set()
        threads[0].join(60)
        assert seen[0] >= seen[1], "the remaining member holds the partitions of the one that left"
        assert sum(m.stats.consumed for m in members) >= len(records) + len(later)
        assert_stored_once(store, "shared", records)
        assert_stored_once(store, "shared-later", later)


def test_gzip_message_sets_are_inflated_by_isal_and_come_out_the_same() -> None:
    assert use_isal_gzip(), "isal is a dependency of rankscope[server]"
    payload = b"".join(encode(r)[1] for r in synthetic_records("gz", ranks=4, batches=2))
    for module in (kafka.record.legacy_records, kafka.record.default_records):
        assert module.gzip_decode.__module__.startswith("isal")
        assert module.gzip_decode(gzip_encode(payload)) == payload


def test_serve_consumes_the_topic_and_opens_the_ticket(broker: KafkaBroker, tmp_path: Path) -> None:
    """``rankscope serve --kafka``: a recorded real run (rank 2 computes slower) arrives by Kafka."""
    from rankscope.api import ServeSettings, Service

    fixture = Path(__file__).parent / "fixtures" / "compute-r2"
    items = []
    for gz in sorted(fixture.glob("*.jsonl.gz")):
        key = f"compute-r2/{gz.name.split('rank')[1].split('.')[0]}".encode()
        items += [(key, line) for line in gzip.decompress(gz.read_bytes()).splitlines()]
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
    """``benchmarks.ingest --ranks``: the records of ranks' hooks at their defaults, through Kafka."""
    from benchmarks import ingest

    out = tmp_path / "ingest.json"
    argv = ["--ranks", "8", "--minutes", "1", "--functions", "20", "--kafka", broker.bootstrap]
    assert ingest.main([*argv, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    # Per rank: its rank record, a step record every 2 s, a heartbeat every 5 s, a window every 30 s.
    assert r["records"] == 8 * (1 + 30 + 12 + 2) and r["records_per_s"] > 0, r
