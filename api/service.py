"""The always-on service behind ``rankscope serve``: ingest, diagnose every running job, keep tickets.

One cycle (every ``interval_s``): read what the spool gained (offsets committed as ``rankscope
ingest`` does; with Kafka, ``rankscope aggregate`` fills the same store), diagnose each job that
sent something since its last diagnosis, keep the diagnosis in the history, and reconcile the job's
tickets (:mod:`api.tickets`), notifying the webhooks of tickets opened and resolved. A job that
sent nothing for ``ended_after_s`` has ended: its tickets resolve.

Replicas on one ClickHouse server share the jobs: each cycle a replica notes itself in the store
(``serve_replicas``) with its lease, and of the replicas whose lease runs each job is diagnosed by one,
chosen by rendezvous hashing (the largest hash of job and replica): a replica that joins or dies
moves only the jobs it takes or held. The others show that replica's diagnoses and tickets, read
from the store.

The store is used by one thread at a time (``lock``): chDB is one engine per process.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rankscope.aggregator import RankscopeError, Store, ingest
from rankscope.aggregator.consumer import Aggregator, BatchSettings, KafkaSettings
from rankscope.diagnosis import Diagnosis, Finding, JobData, diagnose, read_job
from rankscope.diagnosis.data import RecentJob
from rankscope.diagnosis.efficiency import Efficiency
from rankscope.diagnosis.efficiency import read as read_efficiency
from rankscope.diagnosis.ettr import Reliability, measure, read_run
from rankscope.renderers.html import MAX_POINTS, culprit_ranks, heatmap_data, per_step, pictures, step_series
from rankscope.wire.errors import UsageError
from rankscope.wire.settings import check_numbers

from . import storage
from .notify import Notifier, Webhook
from .tickets import Event, Ticket, TicketSettings, reconcile

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeSettings:
    """What ``rankscope serve`` runs with (its command's options)."""

    spool: str | None = None
    """Spool directory the hooks write, watched every cycle (None: the store is filled otherwise)."""
    kafka: KafkaSettings | None = None
    """Consume the hooks' topic too, as one member of the consumer group (``rankscope aggregate``)."""
    interval_s: float = 5.0
    """Seconds between cycles."""
    ended_after_s: float = 60.0
    """A job that sent nothing (steps, heartbeats) for this long has ended."""
    recent_s: float = 600.0
    """Each diagnosis reads the job's last this-many seconds of steps and windows: a fault that
    stopped leaves the findings (its ticket resolves), and a cycle costs the same at any job age."""
    watch_s: float = 300.0
    """A job whose page or pictures were asked for in the last this-many seconds has them drawn
    after each of its diagnoses, so that a page refresh finds them ready; the others' are drawn when
    asked for. At 1,000 ranks of 100 ms steps drawing takes ~2 s, as long as the diagnosis."""
    tickets: TicketSettings = field(default_factory=TicketSettings)
    """When tickets open and resolve."""
    webhooks: tuple[Webhook, ...] = ()
    """Notified of each ticket opened and resolved."""
    base_url: str = "http://127.0.0.1:8080"
    """Where people reach this service: links in notifications."""
    replica: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    """This replica's name among those sharing the store."""
    lease_s: float = 0.0
    """A replica not seen for this long is gone, and its jobs go to the others at their next cycle.
    0: one ``interval_s`` where the service runs (:meth:`Service.start`), which notes its replica
    alive every half interval on a connection of its own, whatever its cycles take; where cycles
    are driven one by one (:meth:`Service.cycle`), each notes it, for two ``interval_s`` and two
    of its last cycle's duration (a large job's cycle is no death)."""

    def __post_init__(self) -> None:
        check_numbers(self)
        if self.interval_s <= 0:
            raise UsageError(f"ServeSettings.interval_s must be > 0, got {self.interval_s}")


@dataclass(slots=True)
class JobState:
    """What the service knows about one job after its last cycle."""

    job: str
    ranks: int
    world_size: int
    first_us: int
    last_us: int
    step: int = -1
    steps_per_s: float = 0.0
    diagnosis: dict[str, Any] | None = None
    diagnosed_us: int = 0
    data_last_us: int = -1
    """The job's ``last_us`` when it was last diagnosed: a job is diagnosed again only after it grew."""
    recent: RecentJob | None = None
    """Its recent data, brought up to date each time it is diagnosed (what the pictures show)."""
    pending: dict[str, int] = field(default_factory=dict)
    """Its findings not yet ticketed: fingerprint -> first seen (``TicketSettings.open_after_s``). Held in
    memory: a replica that takes the job over, or a restarted service, watches them afresh."""

    def adopt(self, stored: dict[str, Any]) -> None:
        """Take a stored diagnosis (one of ``storage.diagnoses``) as the job's latest."""
        doc = stored["diagnosis"]
        self.diagnosis, self.diagnosed_us = doc, stored["time_us"]
        self.data_last_us = int(doc.get("data_last_us", -1))

    def state(self, now_us: int, ended_after_s: float) -> str:
        if now_us - self.last_us >= ended_after_s * 1e6:
            return "ended"
        findings = (self.diagnosis or {}).get("findings", [])
        if any(f["cause"] == "hang" for f in findings):
            return "hung"
        return "slow" if findings else "running"


@dataclass(slots=True)
class Stats:
    cycles: int = 0
    cycle_errors: int = 0
    last_cycle_s: float = 0.0
    last_views_s: float = 0.0
    """Seconds the last cycle spent drawing the pictures of the jobs it diagnosed (part of ``last_cycle_s``)."""
    last_cycle_end: float = 0.0
    ingested: int = 0
    dead_letters: int = 0
    cycle_problem: str = ""
    """Why the last cycle failed ('' if it did not): the store is unreachable, full…"""
    kafka_problem: str = ""
    """Why the Kafka consumer stopped ('' while it runs): a later cycle that succeeds does not clear it."""

    @property
    def problem(self) -> str:
        return "; ".join(p for p in (self.cycle_problem, self.kafka_problem) if p)


class Service:
    def __init__(self, store: Store, settings: ServeSettings) -> None:
        self.store, self.settings = store, settings
        self.lock = threading.RLock()
        self.stats = Stats()
        self.jobs: dict[str, JobState] = {}
        """Job id -> state; with :attr:`tickets`, written by the cycle's thread only (readers copy
        ``list(d.values())`` first: a copy made in C, not a Python loop another thread can interleave)."""
        self.now_us = time.time_ns() // 1000
        """The time of the last cycle: the API tells jobs' states as of then."""
        with self.lock:
            storage.create_tables(store)
            self.tickets = {t.id: t for t in map(Ticket.from_dict, storage.load_tickets(store))}
            self._resume_jobs()
        self.notifier = Notifier(settings.webhooks, self._record_delivery)
        self._views: dict[str, tuple[JobData, dict[str, Any]]] = {}
        """Job id -> (the data its last diagnosis read, what was drawn from it by name)."""
        self._asked: dict[str, float] = {}
        """Job id -> when (``time.monotonic()``) one of its views was last asked for."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.aggregator: Aggregator | None = None
        self._consumer: threading.Thread | None = None
        self._beats: threading.Thread | None = None
        self._beaten = threading.Event()
        self.replicas = [settings.replica]
        """The live replicas as of the last cycle (this one among them)."""

    # --- the loop -------------------------------------------------------------------------------

    def start(self) -> None:
        if self.settings.kafka is not None:
            self._consumer = threading.Thread(target=self._consume, name="rankscope-kafka", daemon=True)
            self._consumer.start()
        if self.store.reopen is not None:
            self._beats = threading.Thread(target=self._beat, name="rankscope-replica", daemon=True)
            self._beats.start()
        self._thread = threading.Thread(target=self._run, name="rankscope-serve", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in (self._thread, self._consumer, self._beats):
            if thread is not None:
                thread.join()
        self.notifier.close()

    def _consume(self) -> None:
        """Kafka into the store, on connections of its own (the aggregator's writers are threads)."""
        assert self.settings.kafka is not None
        reopen = self.store.reopen
        store = reopen() if reopen is not None else self.store
        try:
            self.aggregator = Aggregator(store, self.settings.kafka, BatchSettings())
            self.aggregator.run(stop=self._stop)
        except Exception as exc:  # the spool and the API go on; /healthz says why Kafka stopped
            self.stats.kafka_problem = f"Kafka consumer stopped: {type(exc).__name__}: {exc}"[:500]
            log.exception("rankscope serve: the Kafka consumer stopped")
        finally:
            if store is not self.store:
                store.close()

    def _beat(self) -> None:
        """This replica noted alive every half interval until stopped, on a connection of its own
        (a cycle holds the service's for as long as a large job's reads take): a replica that dies
        is gone within an interval, and its jobs are taken at the others' next cycle."""
        assert self.store.reopen is not None
        store = self.store.reopen()
        try:
            while not self._stop.is_set():
                now = time.time_ns() // 1000
                lease_s = self.settings.lease_s or self.settings.interval_s
                try:
                    storage.beat(store, self.settings.replica, now, now + int(lease_s * 1e6))
                except RankscopeError as exc:  # the store is away: the cycles say so too
                    log.warning("rankscope serve: noting this replica alive failed: %s", exc)
                self._beaten.set()
                self._stop.wait(self.settings.interval_s / 2)
        finally:
            store.close()

    def _run(self) -> None:
        if self._beats is not None:  # the first cycle counts this replica among the live ones
            self._beaten.wait(self.settings.interval_s)
        while not self._stop.is_set():
            self.cycle()
            self._stop.wait(self.settings.interval_s)

    def cycle(self, now_us: int | None = None) -> None:
        """One cycle; ``now_us`` (default: the clock) decides which jobs have ended. Never raises."""
        t0 = time.perf_counter()
        try:
            self.now_us = now_us if now_us is not None else time.time_ns() // 1000
            self._cycle(self.now_us)
            self.stats.cycle_problem = ""
        except RankscopeError as exc:
            self.stats.cycle_errors += 1
            self.stats.cycle_problem = str(exc).splitlines()[0][:500]
            log.warning("rankscope serve: cycle failed: %s", self.stats.cycle_problem)
        except Exception as exc:  # a bug must not stop the service watching the other jobs
            self.stats.cycle_errors += 1
            self.stats.cycle_problem = f"{type(exc).__name__}: {exc}"[:500]
            log.exception("rankscope serve: cycle failed")
        self.stats.cycles += 1
        self.stats.last_cycle_s = time.perf_counter() - t0
        self.stats.last_cycle_end = time.time()

    def _cycle(self, now_us: int) -> None:
        with self.lock:
            if self.settings.spool and Path(self.settings.spool).is_dir():
                st = ingest(self.settings.spool, self.store)
                self.stats.ingested += st.records
                self.stats.dead_letters += st.dead_letters
            jobs, rates = self.store.jobs(), self.store.step_rates().set_index("job")
            if self._beats is None:  # cycles driven one by one: each notes the replica alive
                lease_s = self.settings.lease_s or 2 * (self.settings.interval_s + self.stats.last_cycle_s)
                storage.beat(self.store, self.settings.replica, now_us, now_us + int(lease_s * 1e6))
            self.replicas = storage.live_replicas(self.store, now_us) or [self.settings.replica]
        for row in jobs.itertuples(index=False):
            job = str(row.job)
            js = self.jobs.get(job)
            if js is None:
                js = self.jobs[job] = JobState(job, 0, 0, 0, 0)
            js.ranks, js.world_size = int(row.ranks), int(row.world_size)
            js.first_us, js.last_us = int(row.first_us), int(row.last_us)
            if job in rates.index:
                js.step, js.steps_per_s = int(rates.at[job, "step"]), float(rates.at[job, "steps_per_s"])
            ended = now_us - js.last_us >= self.settings.ended_after_s * 1e6
            if not self.owns(job):
                js.recent = None
                if js.last_us != js.data_last_us:
                    self._follow(js)
            elif js.last_us != js.data_last_us:
                self._diagnose(js, now_us, ended)
            elif ended and (
                js.pending or any(t.waits_for_end for t in self.tickets.values() if t.job == job)
            ):
                self._reconcile(js, [], now_us, ended=True)
            elif js.pending:  # (an ended job's pending findings were dropped just above)
                # Nothing new to diagnose: its latest diagnosis stands, and its watched findings
                # hold on (a job that stopped growing ends, or opens their tickets, not neither).
                findings = self.diagnosis_or_empty(job).findings
                self._reconcile(js, findings, now_us, ended=False)

    def owns(self, job: str, among: list[str] | None = None) -> bool:
        """Whether this replica diagnoses ``job``: of the live replicas (or ``among``), the one whose
        name hashed with the job's is the largest."""

        def rank(replica: str) -> bytes:
            return hashlib.blake2b(f"{job}\0{replica}".encode(), digest_size=8).digest()

        return max(among or self.replicas, key=rank) == self.settings.replica

    def _follow(self, js: JobState) -> None:
        """A job another replica diagnoses: its latest diagnosis and tickets, from the store."""
        with self.lock:
            last = storage.diagnoses(self.store, js.job, 1)
            self._refresh_tickets(js.job)
        if last and last[0]["time_us"] > js.diagnosed_us:
            js.adopt(last[0])

    def _diagnose(self, js: JobState, now_us: int, ended: bool) -> None:
        if js.recent is None:
            js.recent = RecentJob(js.job, self.settings.recent_s)
        with self.lock:
            data = js.recent.update(self.store, js.last_us, self.settings.recent_s)
        d = diagnose(data)
        doc = {**d.to_dict(), "time_us": now_us, "data_last_us": js.last_us}
        js.diagnosis, js.diagnosed_us, js.data_last_us = doc, now_us, js.last_us
        with self.lock:
            storage.save_diagnosis(self.store, js.job, now_us, doc)
        self._reconcile(js, d.findings, now_us, ended)
        t, self.stats.last_views_s = time.perf_counter(), 0.0
        if time.monotonic() - self._asked.get(js.job, -math.inf) < self.settings.watch_s:
            for name in VIEWS:  # drawn now, so that the next request need not wait for it
                self.view(js.job, name, asked=False)
            self.stats.last_views_s = time.perf_counter() - t

    def _reconcile(self, js: JobState, findings: list[Finding], now_us: int, ended: bool) -> None:
        world = max(js.world_size, js.ranks)
        with self.lock:  # the API's ticket actions change tickets too
            self._refresh_tickets(js.job)
            changes = reconcile(
                self.tickets, js.job, findings, now_us, world, self.settings.tickets, ended, js.pending
            )
            if not changes:
                return
            storage.save_tickets(self.store, [c.ticket.to_dict() for c in changes])
        for c in changes:
            if c.kind != "updated" and not c.ticket.silenced:
                self.notifier.send(c.ticket.to_dict(), self.ticket_link(c.ticket.id))
            if c.kind != "updated":
                log.warning(
                    "rankscope serve: ticket %s %s: %s", c.ticket.id, c.kind, c.ticket.events[-1].reason
                )

    def _refresh_tickets(self, job: str) -> None:
        """The job's tickets as the store holds them, where they are newer than this service's:
        another ``serve`` replica on the same server changed them (its own diagnosis, or a person
        acknowledging one through its API). Replicas name a ticket alike (its id is a function of
        the finding), so they update one ticket, not one each."""
        for doc in storage.load_tickets(self.store, job):
            held = self.tickets.get(doc["id"])
            if held is None or doc["updated_us"] > held.updated_us:
                self.tickets[doc["id"]] = Ticket.from_dict(doc)

    def _resume_jobs(self) -> None:
        """After a restart: each job's latest diagnosis, so that nothing is diagnosed (or ticketed) twice."""
        jobs = self.store.jobs()
        for job in jobs["job"]:
            last = storage.diagnoses(self.store, str(job), 1)
            if last:
                js = self.jobs[str(job)] = JobState(str(job), 0, 0, 0, 0)
                js.adopt(last[0])

    # --- what the API reads ---------------------------------------------------------------------

    def ticket_link(self, ticket_id: str) -> str:
        return f"{self.settings.base_url.rstrip('/')}/tickets/{ticket_id}"

    def job_data(self, job: str) -> JobData:
        """What the pictures show: the data the job's last diagnosis read."""
        js = self.jobs.get(job)
        if js is not None and js.recent is not None and js.recent.data is not None:
            return js.recent.data
        with self.lock:  # not diagnosed since this service started
            return read_job(self.store, job, since_us=self._since(js))

    def _since(self, js: JobState | None) -> int | None:
        return js.last_us - int(self.settings.recent_s * 1e6) if js is not None else None

    def view(self, job: str, name: str, asked: bool = True) -> Any:
        """``VIEWS[name]`` of what the job's last diagnosis read: drawn once per diagnosis, by the
        cycle for a job someone is watching (``asked`` for in the last ``watch_s``)."""
        if asked:
            self._asked[job] = time.monotonic()
        return self._drawn(job, self.job_data(job), name)

    def _drawn(self, job: str, data: JobData, name: str) -> Any:
        """``VIEWS[name]`` of ``data``, drawn once; views that build on another draw it from the
        same ``data`` (not from a second :meth:`job_data`, which reads the store again for a job
        not diagnosed yet)."""
        held = self._views.get(job)
        if held is None or held[0] is not data:
            held = self._views[job] = (data, {})
        if name not in held[1]:
            held[1][name] = VIEWS[name](self, job, data)
        return held[1][name]

    def diagnosis(self, job: str) -> Diagnosis | None:
        doc = self.jobs[job].diagnosis if job in self.jobs else None
        if doc is None:
            return None
        return Diagnosis(
            job=doc["job"], findings=[Finding(**f) for f in doc["findings"]], analyzed=doc["analyzed"]
        )

    def efficiency(self, job: str) -> Efficiency | None:
        """Where the job's recent time went, per rank (None before its first step)."""
        return self.view(job, "efficiency")  # type: ignore[no-any-return]

    def _efficiency(self, job: str, data: JobData) -> Efficiency | None:
        with self.lock:
            return read_efficiency(self.store, job, self._since(self.jobs.get(job)), data.steps)

    def diagnosis_or_empty(self, job: str) -> Diagnosis:
        """The job's latest diagnosis, or one without findings before its first."""
        return self.diagnosis(job) or Diagnosis(job=job, findings=[])

    def reliability(self, job: str) -> Reliability | None:
        """The job's ETTR so far and the time it lost (None before its first step)."""
        with self.lock:
            run = read_run(self.store, job)
        return measure(run) if not run.steps.empty else None

    def history(self, job: str, limit: int) -> list[dict[str, Any]]:
        with self.lock:
            return storage.diagnoses(self.store, job, limit)

    def deliveries(self, ticket_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return storage.deliveries(self.store, ticket_id)

    def change_ticket(self, ticket_id: str, action: str, reason: str) -> Ticket:
        """``acknowledge``, ``resolve``, ``silence`` or ``unsilence`` a ticket by hand."""
        with self.lock:  # not in the middle of a cycle's reconciliation of the same ticket
            t = self.tickets[ticket_id]
            now = time.time_ns() // 1000
            if action == "acknowledge" and t.state == "open":
                t.move(now, "acknowledged", reason or "acknowledged")
            elif action == "resolve" and t.active:
                t.move(now, "resolved", reason or "resolved by hand")
                if not t.silenced:
                    self.notifier.send(t.to_dict(), self.ticket_link(t.id))
            elif action in ("silence", "unsilence"):
                t.silenced = action == "silence"
                t.updated_us = now
                t.events.append(Event(now, t.state, reason or f"{action}d"))
            storage.save_tickets(self.store, [t.to_dict()])
            return t

    def _record_delivery(
        self, ticket: str, time_us: int, url: str, status: str, attempt: int, error: str
    ) -> None:
        with self.lock:
            storage.save_delivery(self.store, ticket, time_us, url, status, attempt, error)


VIEWS: dict[str, Callable[[Service, str, JobData], Any]] = {
    "per_step": lambda svc, job, data: per_step(data, culprit_ranks(svc.diagnosis_or_empty(job))),
    "heatmap": lambda svc, job, data: heatmap_data(data, svc._drawn(job, data, "per_step")),
    "steps": lambda svc, job, data: step_series(
        data, MAX_POINTS, culprits=culprit_ranks(svc.diagnosis_or_empty(job))
    ),
    "pictures": lambda svc, job, data: pictures(
        svc.diagnosis_or_empty(job), data, svc._drawn(job, data, "per_step")
    ),
    "efficiency": lambda svc, job, data: svc._efficiency(job, data),
}
"""What the API and the job page show of a job's data, drawn once per diagnosis (:meth:`Service.view`):
at 1,000 ranks each takes from 0.1 to 1 s, where a page must answer in milliseconds."""
