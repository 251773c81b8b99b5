"""Consume ranks' records from Kafka into the store: ``rankscope aggregate``.

One :class:`Aggregator` is one member of a Kafka consumer group: start several with the same
group and they split the topic's partitions between them (Kafka rebalances when one joins or dies).

Delivery is at-least-once and the result exactly-once:

* messages are decoded and checked into a :class:`~aggregator.batch.Batch`; one that does not decode
  or fit (malformed, oversized, unknown version) becomes a dead letter with its reason, raw bytes,
  and its place (``source = "kafka:<topic>/<partition>"``, ``position = <offset>``);
* a batch is written when it holds ``batch_records`` messages or is ``batch_seconds`` old;
* offsets are committed only after the batch is stored. A failing insert is retried with backoff
  (the database may be restarting) and nothing is committed meanwhile;
* a crash between insert and commit, or a rebalance, redelivers messages that were stored already:
  the store's ReplacingMergeTree tables (read with ``FINAL``) keep one row per key, so every record
  appears once in query results.

Example::

    with Store.embedded("/var/lib/rankscope/db") as store:
        agg = Aggregator(store, KafkaSettings(bootstrap="kafka:9092"))
        agg.run(stop=threading.Event())
"""

from __future__ import annotations

import difflib
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rankscope.wire.errors import StoreError, UsageError
from rankscope.wire.kafka import api_version_kwargs
from rankscope.wire.settings import check_numbers

from .batch import Batch
from .metrics import Metrics
from .store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class KafkaSettings:
    bootstrap: str
    """Comma-separated ``host:port`` list."""
    topic: str = "rankscope"
    """The topic the hooks produce to."""
    group: str = "rankscope-aggregator"
    """The consumer group: aggregators of one group share the topic's partitions."""
    client_id: str = "rankscope-aggregator"
    """This client's name in the broker's logs."""
    api_version: str = ""
    """E.g. ``"0.9"`` for the test broker; leave empty in production (the client probes)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Passed through to ``KafkaConsumer`` (SASL/SSL settings, fetch sizes…); see :meth:`check`."""

    def __post_init__(self) -> None:
        for name in ("bootstrap", "topic", "group"):
            if not getattr(self, name):
                raise UsageError(f"KafkaSettings.{name} must not be empty")

    def check(self) -> None:
        """Refuse (:class:`~aggregator.errors.UsageError`) an option ``KafkaConsumer`` does not know,
        or one whose value is not of the type of its default (``session_timeout_ms="abc"``): the
        client would take it and fail later, deep inside, or never."""
        from kafka import KafkaConsumer

        defaults = KafkaConsumer.DEFAULT_CONFIG
        for key, value in self.options.items():
            if key not in defaults:
                near = difflib.get_close_matches(key, defaults, n=1)
                hint = f" (did you mean {near[0]}?)" if near else ""
                raise UsageError(f"unknown Kafka consumer option {key!r}{hint}")
            want = _option_type(defaults[key])
            if want is not None and not _is_a(value, want):
                raise UsageError(
                    f"Kafka option {key}={value!r} must be {_TYPE_NAMES[want]} (its default is {defaults[key]!r})"
                )

    def consumer_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap.split(","),
            "group_id": self.group,
            "client_id": self.client_id,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            # A member that died is replaced after this long (the client's 45 s default is slow).
            "session_timeout_ms": 10_000,
            "heartbeat_interval_ms": 3_000,
            # Summaries are up to 1 MB; fetch several per partition per round trip.
            "max_partition_fetch_bytes": 8 << 20,
            # One attempt to reach a broker when the API version is probed (see Aggregator._connect).
            "bootstrap_timeout_ms": 10_000,
            # Back within a second of a broker's return (the Java client's default; kafka-python's
            # 30 s backoff can leave it away for tens of seconds after a long outage).
            "reconnect_backoff_max_ms": 1_000,
            **self.options,
        }
        kw.update(api_version_kwargs(self.api_version))
        return kw


POLL_STALL_S = 2.0
"""A poll of at most 200 ms that takes longer hung on an away broker (or a rebalance): while idle
exit is on, quiet starts over after it."""

_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _option_type(default: Any) -> type | None:
    """The type a Kafka option must have, from its default value; None where any goes."""
    return next((t for t in _TYPE_NAMES if type(default) is t), None)


def _is_a(value: Any, want: type) -> bool:
    if want is float:
        return type(value) in (int, float)
    return type(value) is want  # bool is not an int here, nor an int a bool


def _bootstrapped(consumer: Any) -> bool:
    """Whether ``consumer`` has reached a broker and read the cluster's metadata.

    kafka-python 3 tells it only through its connection manager (``KafkaConsumer.bootstrap`` can
    block for good once a background bootstrap without a deadline is under way); a client without
    that attribute is taken as bootstrapped, as before.
    """
    return bool(getattr(getattr(consumer, "_manager", None), "bootstrapped", True))


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchSettings:
    records: int = 5000
    """Write once the batch holds this many messages… (20,000 made a backlog of window summaries
    ~11% slower here, 1,144 and 1,438 summaries/s against 1,291 and 1,614: bigger polls overlap
    less with the writers; a job's steady stream closes its batches at ``seconds`` anyway)"""
    bytes: int = 64 << 20
    """…or this many bytes of messages (~1,700 window summaries)…"""
    seconds: float = 1.0
    """…or once its first message is this old."""
    retry_s: float = 0.5
    """First wait before retrying a failed insert; doubles up to ``retry_max_s``."""
    retry_max_s: float = 30.0
    """The longest wait between retries."""
    writers: int = 2
    """Batches written at once, each through its own connection (one more parses while one waits)."""

    def __post_init__(self) -> None:
        check_numbers(self)
        for name in ("records", "bytes", "writers"):
            if getattr(self, name) < 1:
                raise UsageError(f"BatchSettings.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(slots=True)
class AggregateStats:
    """Totals of one :meth:`Aggregator.run` (this process's view; redeliveries count again)."""

    consumed: int = 0
    stored: int = 0
    dead_letters: int = 0
    batches: int = 0
    insert_failures: int = 0
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class _Write:
    """A batch on the writer thread, with the offsets to commit once it is stored."""

    batch: Batch
    offsets: dict[Any, int]
    t0: float
    future: Future[int | None]


def use_isal_gzip() -> bool:
    """Let kafka-python inflate gzip message sets with ISA-L (``isal``) when it is installed.

    kafka-python inflates through the standard library's ``gzip`` module; ISA-L inflates the same
    bytes ~2.7x faster (0.033 vs 0.091 ms per 37 KB summary), a tenth of the aggregator's CPU per
    summary. kafka-python's record modules import ``gzip_decode`` by name, so each module's reference
    is replaced; without ``isal`` nothing changes. Returns whether ISA-L is in use.
    """
    try:
        from isal import igzip
    except ImportError:
        return False
    import kafka.codec
    import kafka.record.default_records
    import kafka.record.legacy_records

    for module in (kafka.codec, kafka.record.default_records, kafka.record.legacy_records):
        module.gzip_decode = igzip.decompress  # type: ignore[attr-defined]
    return True


class Aggregator:
    """One consumer-group member: Kafka → validate → batched insert → commit."""

    def __init__(
        self,
        store: Store,
        kafka: KafkaSettings,
        batching: BatchSettings | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.store = store
        self.kafka = kafka
        self.batching = batching or BatchSettings()
        self.metrics = metrics or Metrics()
        self.stats = AggregateStats()
        self._batch = Batch()
        self._offsets: dict[Any, int] = {}  # TopicPartition -> next offset to commit
        self._batch_t0 = 0.0
        self._consumer: Any = None
        self._in_flight: deque[_Write] = deque()
        self._writers = 1
        self._gave_up = False
        self._partitions: set[int] = set()  # of the topic, seen by the idle check
        self._stores: queue.SimpleQueue[Store] = queue.SimpleQueue()
        self._stop = threading.Event()

    @property
    def assignment(self) -> set[Any]:
        """The partitions this member owns now."""
        return set(self._consumer.assignment()) if self._consumer is not None else set()

    def run(self, stop: threading.Event | None = None, idle_exit_s: float | None = None) -> AggregateStats:
        """Consume until ``stop`` is set (or, with ``idle_exit_s``, once idle that long: see :meth:`_drained`).

        Stores and commits the pending batch before returning. Broker outages are waited out, at
        start-up too (see :meth:`_connect`): the client reconnects with backoff and this loop keeps
        polling; the idle time counts only while a broker answers. Raises
        :class:`~aggregator.errors.UsageError` for Kafka options the client does not take.
        """
        from kafka import ConsumerRebalanceListener

        self.kafka.check()
        use_isal_gzip()
        agg = self

        class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
            def on_partitions_revoked(self, revoked: Any) -> None:
                agg._on_revoked()

            def on_partitions_assigned(self, assigned: Any) -> None:
                agg._gave_up = False  # positions restart from the committed offsets
                log.info("partitions assigned", extra={"partitions": sorted(str(tp) for tp in assigned)})

        if stop is not None:
            self._stop = stop
        t0 = time.perf_counter()
        reopen = self.store.reopen
        self._writers = max(1, self.batching.writers) if reopen is not None else 1
        extra = [reopen() for _ in range(self._writers - 1)] if reopen is not None else []
        for st in (self.store, *extra):
            self._stores.put(st)
        self._writer = ThreadPoolExecutor(max_workers=self._writers, thread_name_prefix="rankscope-writer")
        try:
            self._consumer = self._connect()
            if self._consumer is not None:  # None: stopped before a broker answered
                self._consumer.subscribe([self.kafka.topic], listener=_Listener())
                log.info("aggregator started", extra={"topic": self.kafka.topic, "group": self.kafka.group})
                self._consume(idle_exit_s)
            self._flush(wait=True)
        finally:
            # No autocommit: only what was stored above is committed.
            self._writer.shutdown(wait=True)
            for st in extra:
                st.close()
            if self._consumer is not None:
                self._consumer.close(autocommit=False)
            self.stats.seconds += time.perf_counter() - t0
            log.info(
                "aggregator stopped",
                extra={
                    "consumed": self.stats.consumed,
                    "stored": self.stats.stored,
                    "dead_letters": self.stats.dead_letters,
                },
            )
        return self.stats

    def stop(self) -> None:
        """Ask :meth:`run` to store what it holds and return (from any thread or a signal handler)."""
        self._stop.set()

    # --- internals ------------------------------------------------------------------------------

    def _connect(self) -> Any:
        """A consumer that has reached a broker; None if :meth:`stop` came first.

        No broker answering at start-up is an outage like one mid-run, and is waited out the same
        way, for as long as it lasts (with ``idle_exit_s`` too: quiet while no broker answers is
        not idle). Without an API version the client asks a broker for it while it is made, for up
        to ``bootstrap_timeout_ms`` (10 s), and raises if none answers: it is made again after
        ``retry_s``. With an API version it is made at once and reaches a broker in the background,
        reconnecting with backoff (up to ``reconnect_backoff_max_ms``, 1 s), as it does mid-run;
        until then the idle check's metadata request would block, so this waits for it here.
        """
        from kafka import KafkaConsumer
        from kafka.errors import KafkaConfigurationError, KafkaError

        kwargs = self.kafka.consumer_kwargs()
        make_client = kwargs.get("kafka_client", KafkaConsumer.DEFAULT_CONFIG["kafka_client"])
        where = self.kafka.bootstrap
        t0 = time.monotonic()
        warned = t0
        made: list[Any] = []  # the clients an attempt made, to close if it fails

        def client(**config: Any) -> Any:
            made.append(make_client(**config))
            return made[-1]

        while not self._stop.is_set():
            made.clear()
            try:
                consumer = KafkaConsumer(**{**kwargs, "kafka_client": client})
            except KafkaConfigurationError as exc:
                for c in made:
                    c.close()
                raise UsageError(f"Kafka consumer settings refused: {exc}") from None
            except KafkaError as exc:
                for c in made:  # the half-made consumer's network thread and sockets
                    c.close()
                log.warning(
                    "no Kafka broker answers at %s (for %.0f s now): %s; trying again in %.1f s",
                    where, time.monotonic() - t0, exc, self.batching.retry_s,
                )  # fmt: skip
                self._stop.wait(self.batching.retry_s)
                continue
            while not _bootstrapped(consumer) and not self._stop.wait(0.1):
                if time.monotonic() - warned >= 10:
                    warned = time.monotonic()
                    log.warning("no Kafka broker answers at %s (for %.0f s now); waiting", where, warned - t0)
            if _bootstrapped(consumer):
                if time.monotonic() - t0 >= 1:
                    log.warning("a Kafka broker at %s answers after %.0f s", where, time.monotonic() - t0)
                return consumer
            consumer.close(autocommit=False)
        return None

    def _consume(self, idle_exit_s: float | None) -> None:
        """The loop of :meth:`run`: poll, batch, store, commit; until stopped or idle."""
        from kafka.errors import KafkaError

        quiet_since = next_check = time.monotonic()
        while not self._stop.is_set():
            polled_at = time.monotonic()
            try:
                polled = self._consumer.poll(timeout_ms=self._poll_ms(), max_records=self.batching.records)
                if time.monotonic() - polled_at > POLL_STALL_S:  # it hung: no broker answered
                    quiet_since = time.monotonic()
            except KafkaError as exc:  # the broker is away: keep the batch, wait, poll again
                log.warning("Kafka poll failed; retrying: %s", exc)
                polled = {}
                quiet_since = time.monotonic()
                self._stop.wait(self.batching.retry_s)
            n = 0
            for messages in polled.values():
                for m in messages:
                    self._take(m)
                n += len(messages)
            if n:
                quiet_since = time.monotonic()
                self._update_lag()
            if self._due():
                self._flush()
            else:
                self._finish(wait=False)  # commit what is stored already
            if idle_exit_s is None:
                continue
            # Quiet counts from the broker's last answer as well as the last message: producers
            # need a moment after an outage to send what they held. So while quiet, the broker is
            # asked every second, and an outage shorter than the idle time is seen all the same.
            now = time.monotonic()
            if now - quiet_since < 1.0 or now < next_check:
                continue
            drained = self._drained()
            now = next_check = time.monotonic()
            next_check += 1.0
            if drained is None:
                quiet_since = now
            elif drained and now - quiet_since >= idle_exit_s:
                log.info("no messages for %.1f s and the group has read the topic; stopping", idle_exit_s)
                break

    def _poll_ms(self) -> int:
        if not len(self._batch):
            return 200
        left = self._batch_t0 + self.batching.seconds - time.monotonic()
        return max(0, min(200, int(left * 1000)))

    def _due(self) -> bool:
        n = len(self._batch)
        return (
            n >= self.batching.records
            or self._batch.nbytes >= self.batching.bytes
            or (n > 0 and time.monotonic() - self._batch_t0 >= self.batching.seconds)
        )

    def _take(self, m: Any) -> None:
        from kafka import TopicPartition

        if not len(self._batch):
            self._batch_t0 = time.monotonic()
        self.stats.consumed += 1
        self.metrics.consumed.inc()
        value = m.value if m.value is not None else b""
        self._batch.add_value(f"kafka:{m.topic}/{m.partition}", m.offset, m.key or b"", value)
        self._offsets[TopicPartition(m.topic, m.partition)] = m.offset + 1

    def _flush(self, retry: bool = True, wait: bool = False) -> None:
        """Hand the batch to a writer thread; commit the batches before it as they are stored.

        Batches are written while the next is consumed (chDB and the HTTP client release the GIL),
        ``writers`` at a time, and their offsets are committed in order, on this thread (the
        consumer is not thread-safe).
        """
        if len(self._in_flight) >= self._writers:
            self._finish(wait=True, all_=False)
        if self._offsets:
            batch, offsets = self._batch, self._offsets
            self._reset()
            future = self._writer.submit(self._store, batch, retry)
            self._in_flight.append(_Write(batch, offsets, time.perf_counter(), future))
        if wait:
            self._finish(wait=True)

    def _store(self, batch: Batch, retry: bool) -> int | None:
        """On the writer thread: insert ``batch``; the records stored, or None if given up.

        With ``retry`` a failing insert is retried with backoff until it succeeds or :meth:`stop`
        is called; without, one failure gives the batch up (it is redelivered, never committed).
        """
        store = self._stores.get()  # this thread's connection while it writes
        try:
            return self._write(store, batch, retry)
        finally:
            self._stores.put(store)

    def _write(self, store: Store, batch: Batch, retry: bool) -> int | None:
        wait = self.batching.retry_s
        while True:
            try:
                return store.write_batch(batch)
            except StoreError as exc:
                self.stats.insert_failures += 1
                self.metrics.insert_failures.inc()
                log.warning(
                    "batch insert failed; %s: %s",
                    f"retrying in {wait:.1f} s" if retry else "leaving it uncommitted",
                    exc,
                    extra={"messages": len(batch)},
                )
                if not retry or self._stop.wait(wait):
                    return None
                wait = min(wait * 2, self.batching.retry_max_s)

    def _finish(self, wait: bool, all_: bool = True) -> None:
        """Commit the stored batches at the head of the line, in order.

        With ``wait`` wait for every batch in flight (``all_``) or for the oldest one; without,
        stop at the first that is still being written. A batch given up is not committed.
        """
        first = True
        while self._in_flight and (self._in_flight[0].future.done() or (wait and (all_ or first))):
            first = False
            w = self._in_flight.popleft()
            stored = w.future.result()
            if stored is None:
                # Its messages will come again once positions are reset from the committed
                # offsets (a rebalance, a restart): committing a later batch would skip them.
                self._gave_up = True
            elif not self._gave_up:
                self._committed(w, stored)

    def _committed(self, w: _Write, stored: int) -> None:
        batch = w.batch
        self._commit(w.offsets)
        self.stats.stored += stored
        self.stats.dead_letters += batch.dead_letters
        self.stats.batches += 1
        self.metrics.stored.inc(stored)
        self.metrics.dead_letters.inc(batch.dead_letters)
        self.metrics.batch_records.observe(len(batch))
        self.metrics.batch_seconds.observe(time.perf_counter() - w.t0)
        log.debug(
            "batch stored",
            extra={"records": stored, "dead_letters": batch.dead_letters, "messages": len(batch)},
        )

    def _commit(self, offsets: dict[Any, int]) -> bool:
        from kafka.errors import KafkaError
        from kafka.structs import OffsetAndMetadata

        try:
            self._consumer.commit({tp: OffsetAndMetadata(o, "", -1) for tp, o in offsets.items()})
            self.metrics.commits.inc()
            return True
        except KafkaError as exc:
            # The group moved on (rebalance) or the broker is away: the messages will be delivered
            # again, to this or another member, and stored again without duplicates.
            self.metrics.commit_failures.inc()
            log.warning("offset commit failed; the stored messages will be redelivered: %s", exc)
            return False

    def _reset(self) -> None:
        self._batch = Batch()
        self._offsets = {}

    def _on_revoked(self) -> None:
        # Store what this member holds before its partitions move, so that the next owner starts
        # after it; one attempt only, as the rebalance is waiting (a failure means redelivery).
        self._flush(retry=False, wait=True)

    def _drained(self) -> bool | None:
        """Whether the group has stored and committed the whole topic; None if the broker is away.

        Quiet alone is not idle: while the broker is down (or restarting, which can take longer than
        the idle time on a busy host) no messages arrive although more are on their way.
        """
        from kafka import TopicPartition
        from kafka.errors import KafkaError

        if len(self._batch) or self._gave_up:
            return False
        self._finish(wait=True)
        c = self._consumer
        try:
            # Right after a broker restart the topic's metadata can come back without some of its
            # partitions (no leader elected yet), while producers hold what they will send there:
            # that says nothing about what is left to read. A topic's partitions never go away.
            parts = set(c.partitions_for_topic(self.kafka.topic))
            away = self._partitions - parts
            self._partitions |= parts
            if not parts or away:
                log.info(
                    "not idle: the broker knows %d of the %d partitions of %s (yet)",
                    len(parts),
                    len(self._partitions),
                    self.kafka.topic,
                )
                return None
            tps = [TopicPartition(self.kafka.topic, p) for p in parts]
            ends = c.end_offsets(tps, timeout_ms=2000)
            done = {tp: c.committed(tp, timeout_ms=2000) or 0 for tp in tps}
            # Everything this member has read is stored by now: redo a commit an outage lost.
            lost = {
                tp: ends[tp]
                for tp in c.assignment()
                if tp in ends and done[tp] < ends[tp] <= c.position(tp, timeout_ms=2000)
            }
            if lost and self._commit(lost):
                done.update(lost)
            return all(done[tp] >= ends[tp] for tp in tps)
        except KafkaError as exc:
            log.info("not idle: the broker does not answer (%s)", exc)
            return None

    def _update_lag(self) -> None:
        for tp in self._consumer.assignment():
            high = self._consumer.highwater(tp)
            if high is not None:
                self.metrics.lag.labels(tp.topic, str(tp.partition)).set(
                    max(0, high - self._consumer.position(tp))
                )
