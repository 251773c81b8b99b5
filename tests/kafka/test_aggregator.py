"""``rankscope aggregate`` against a real broker when things fail: killed between insert and commit,
an insert that fails, a commit lost to an outage, partitions missing after a restart, malformed
messages, members joining and leaving a group; gzip message sets inflated by ISA-L. Nothing is lost
and nothing stored twice."""

from __future__ import annotations

import gzip
import json
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kafka.record.default_records
import kafka.record.legacy_records
import pytest
from kafka import KafkaConsumer
from kafka.codec import gzip_encode
from kafka.errors import KafkaConnectionError

from benchmarks.procs import free_port
from rankscope.aggregator import Store, StoreError
from rankscope.aggregator.consumer import (
    Aggregator,
    BatchSettings,
    use_isal_gzip,
)
from rankscope.aggregator.metrics import Metrics
from rankscope.wire.records import (
    MAX_VALUE_BYTES,
    Heartbeat,
    WindowSummary,
    encode,
)
from tests.kafka.common import aggregate, aggregate_cli, settings
from tests.kafka_broker import KafkaBroker, produce
from tests.records import assert_stored_once, expected_counts, synthetic_records

pytestmark = pytest.mark.kafka


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
