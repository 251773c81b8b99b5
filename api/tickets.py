"""Slowdown tickets: opened, updated and resolved from a job's successive diagnoses.

The rules follow what operators already run:

- **Dedup by fingerprint** (PagerDuty's dedup key, Alertmanager's alert fingerprint): job + cause +
  scope + culprit (the ranks, or the NIC, host or switch). A finding with the fingerprint of an
  unresolved ticket updates it (evidence, confidence, lost time) instead of opening another.
- **Pending** (a Prometheus alerting rule's ``for``): a slowdown finding opens its ticket only once
  every diagnosis for ``open_after_s`` has had it (a job-wide one, ``open_after_job_wide_s``); until
  then the job page shows it as watched and nobody is paged. A hang or a failure opens its ticket at once: each is a fact, not a trend (a
  hang has already stood still for ``HangSettings.stall_s``).
- **Resolve** (Alertmanager's ``resolve_timeout``): once the fingerprint has been absent from the
  job's diagnoses for ``resolve_after_s``, or when the job has ended.
- **Regressions** (Sentry): the fingerprint returning after its ticket resolved opens a new
  occurrence, ``<fingerprint>-<n>``, linked to the one before. Ids are a function of the findings
  alone, so two services diagnosing the same job name the same ticket.
- **Grouping**: a NIC-, host- or switch-level ticket absorbs the rank-level tickets of its ranks.

Everything here is pure: findings and times in, ticket changes out; :mod:`api.storage` keeps them.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from rankscope.diagnosis import Finding
from rankscope.diagnosis.detectors.failure import HARDWARE
from rankscope.diagnosis.findings import LEVELS
from rankscope.wire.settings import check_numbers

State = Literal["open", "acknowledged", "resolved"]
STATES: tuple[State, ...] = ("open", "acknowledged", "resolved")
_GROUPS = LEVELS


@dataclass(slots=True)
class Event:
    time_us: int
    state: str
    """The ticket's state after the event."""
    reason: str


@dataclass(slots=True, kw_only=True)
class Ticket:
    id: str
    fingerprint: str
    occurrence: int
    job: str
    cause: str
    scope: str
    culprit: str
    """What the fingerprint names: ``ranks 2``, ``host node1``, ``switch leaf3``, ``job``."""
    ranks: list[int]
    hosts: list[str]
    function: str
    summary: str
    confidence: float
    evidence: dict[str, Any]
    state: State = "open"
    silenced: bool = False
    """No notifications (the ticket still updates and resolves)."""
    opened_us: int
    updated_us: int
    last_seen_us: int
    """When a diagnosis last held the finding."""
    resolved_us: int = 0
    lost_rank_s: float = 0.0
    """Severity: the job time lost so far, in rank-seconds (the culprit's extra time x ranks waiting)."""
    previous: str = ""
    """The id of the occurrence before this one, if the fault came back."""
    events: list[Event] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.state != "resolved"

    @property
    def waits_for_end(self) -> bool:
        """Active, and its job's end would change it: a slowdown's resolves, a failure's says so
        (once: then it waits for a person)."""
        return self.active and not (
            self.cause == "failure" and self.events[-1].reason.startswith(ENDED_AFTER)
        )

    @property
    def severity(self) -> str:
        """``critical`` for a hang, a failure or ≥ 1 rank-hour lost, ``major`` from 1 rank-minute,
        else ``minor``."""
        if self.cause in URGENT or self.lost_rank_s >= 3600:
            return "critical"
        return "major" if self.lost_rank_s >= 60 else "minor"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "severity": self.severity}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ticket:
        d = {k: v for k, v in d.items() if k != "severity"}
        d["events"] = [Event(**e) for e in d.get("events", [])]
        return cls(**d)

    def move(self, now_us: int, state: State, reason: str) -> None:
        self.state = state
        self.updated_us = now_us
        if state == "resolved":
            self.resolved_us = now_us
        self.events.append(Event(now_us, state, reason))


def culprit(f: Finding) -> str:
    if f.scope in _GROUPS:
        return f"{f.scope} {f.evidence.get(f.scope, ','.join(f.hosts))}"
    if f.scope == "job":
        return "job"
    return "ranks " + ",".join(map(str, f.ranks))


def fingerprint(job: str, f: Finding) -> str:
    """The same fault of the same culprit in the same job (a failure: of the same attempt)."""
    parts = [job, f.cause, f.scope, culprit(f)]
    if f.cause == "failure":
        parts.append(f"attempt {f.evidence.get('attempt', '')}")
    key = "\x1f".join(parts)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def lost_rank_s(f: Finding, world_size: int) -> float:
    """The job time ``f`` has cost so far: extra time per step x steps x ranks kept waiting."""
    ev = f.evidence
    if f.cause == "hang":
        return float(ev.get("stalled_for_s", 0.0)) * max(world_size - len(f.ranks), 1)
    extra_ms = float(ev.get("rank_value_ms", 0.0)) - float(ev.get("peer_median_ms", 0.0))
    if f.scope == "job":
        extra_ms = float(ev.get("now_ms", 0.0)) - float(ev.get("baseline_ms", 0.0))
        return max(extra_ms, 0.0) / 1e3 * float(ev.get("held_steps", 0)) * world_size
    if f.scope in _GROUPS:
        per = [e for e in ev.get("per_rank", {}).values() if isinstance(e, dict)]
        extra_ms = max((e.get("rank_value_ms", 0.0) - e.get("peer_median_ms", 0.0) for e in per), default=0.0)
        held = max((e.get("held_steps", 0) for e in per), default=0)
    else:
        held = ev.get("held_steps", 0)
    return max(extra_ms, 0.0) / 1e3 * float(held) * max(world_size - len(f.ranks), 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class TicketSettings:
    """When a finding's ticket opens and resolves."""

    resolve_after_s: float = 60.0
    """A ticket resolves once its finding has been absent this long (Alertmanager's resolve_timeout)."""
    open_after_s: float = 15.0
    """A slowdown finding opens its ticket once every diagnosis this long has had it (Prometheus's
    ``for``). Three of the service's 5-s cycles: a slowdown that costs a job this long costs it
    little, and most of what a healthy job shows comes and goes faster (the fault suite's probes
    of healthy runs: an early job-wide reading for 4-8 s)."""
    open_after_job_wide_s: float = 300.0
    """A job-wide slowdown (every rank slower than the job's own usual pace, no culprit among them)
    opens its ticket once it held this long instead: the 5-minute ``for`` of throughput alerts and
    the short window of the SRE workbook's burn-rate pages. It names nothing to cordon or restart,
    and a shared machine or cluster slows every rank of a healthy job alike for tens of seconds at a
    time; until then the job page shows it as watched."""

    def __post_init__(self) -> None:
        check_numbers(self)


URGENT = ("hang", "failure")
"""Causes whose ticket opens at the first diagnosis that finds them."""


def open_after_s(f: Finding, rules: TicketSettings) -> float:
    """How long a slowdown's finding must hold before its ticket opens."""
    return rules.open_after_job_wide_s if f.cause == "job_wide" else rules.open_after_s


ENDED_AFTER = "the job ended after"


@dataclass(slots=True)
class Change:
    ticket: Ticket
    kind: Literal["opened", "updated", "resolved"]


def reconcile(
    tickets: dict[str, Ticket],
    job: str,
    findings: list[Finding],
    now_us: int,
    world_size: int,
    rules: TicketSettings = TicketSettings(),
    ended: bool = False,
    pending: dict[str, int] | None = None,
) -> list[Change]:
    """Apply one diagnosis of ``job`` to ``tickets`` (id -> ticket, changed in place); the changes.

    ``ended``: the job sends nothing any more; its unresolved tickets resolve. ``pending``: the
    job's findings not yet ticketed (fingerprint -> first seen, changed in place), to open their
    tickets once they held ``rules.open_after_s``; None opens every finding's ticket at once.
    """
    changes: list[Change] = []
    latest: dict[str, Ticket] = {}
    for old in sorted(tickets.values(), key=lambda t: t.occurrence):
        if old.job == job:
            latest[old.fingerprint] = old
    seen: set[str] = set()
    for f in findings if not ended else []:
        fp = fingerprint(job, f)
        seen.add(fp)
        t = latest.get(fp)
        if t is not None and not t.active and _started_again(f):
            continue  # an attempt's failure, said and resolved: the finding stays, and so does that
        if t is not None and t.active:
            t.confidence, t.evidence, t.summary, t.function = f.confidence, f.evidence, f.summary, f.function
            t.ranks, t.hosts = list(f.ranks), list(f.hosts)
            t.lost_rank_s = round(max(t.lost_rank_s, lost_rank_s(f, world_size)), 1)
            t.last_seen_us = t.updated_us = now_us
            changes.append(Change(t, "updated"))
            continue
        if pending is not None and f.cause not in URGENT:
            since = pending.setdefault(fp, now_us)
            if now_us - since < open_after_s(f, rules) * 1e6:
                continue
            del pending[fp]
        occurrence = t.occurrence + 1 if t is not None else 1
        new = Ticket(
            id=f"{fp}-{occurrence}",
            fingerprint=fp,
            occurrence=occurrence,
            job=job,
            cause=f.cause,
            scope=f.scope,
            culprit=culprit(f),
            ranks=list(f.ranks),
            hosts=list(f.hosts),
            function=f.function,
            summary=f.summary,
            confidence=f.confidence,
            evidence=f.evidence,
            opened_us=now_us,
            updated_us=now_us,
            last_seen_us=now_us,
            lost_rank_s=round(lost_rank_s(f, world_size), 1),
            previous=t.id if t is not None else "",
        )
        reason = f"{f.cause} on {new.culprit}: {f.summary}"
        if t is not None:
            reason = f"returned after {t.id} resolved; " + reason
        new.events.append(Event(now_us, "open", reason))
        tickets[new.id] = new
        latest[fp] = new
        changes.append(Change(new, "opened"))
    if pending is not None:
        for fp in set(pending) - seen:
            del pending[fp]  # gone before it held: watched no longer
    groups = [t for t in latest.values() if t.active and t.scope in _GROUPS and t.fingerprint in seen]
    for t in latest.values():
        if not t.active:
            continue
        if t.cause == "failure":
            # Its finding gone (the job's ranks started again, or it ended), or saying the job
            # started again: what came of the job after it.
            went_on = t.fingerprint in seen and _started_again(t)
            if ended and t.evidence.get("started_again"):
                continue  # it said the job went on; the job's end is no news of this attempt
            if (t.fingerprint not in seen or went_on) and (c := _after_failure(t, ended, now_us)):
                changes.append(c)
            continue
        if ended:
            t.move(now_us, "resolved", "the job ended")
        elif t.fingerprint not in seen and now_us - t.last_seen_us >= rules.resolve_after_s * 1e6:
            t.move(now_us, "resolved", f"healthy for {rules.resolve_after_s:g} s")
        elif t.scope == "rank" and (g := next((g for g in groups if set(t.ranks) <= set(g.ranks)), None)):
            t.move(now_us, "resolved", f"absorbed by {g.id} ({g.culprit})")
        else:
            continue
        changes.append(Change(t, "resolved"))
    return changes


def _started_again(f: Finding | Ticket) -> bool:
    """A failure finding (or its ticket) of an attempt the job started again after."""
    return f.cause == "failure" and bool(f.evidence.get("started_again"))


def _after_failure(t: Ticket, ended: bool, now_us: int) -> Change | None:
    """A failure is an event, not a state: its ticket says what came of the job after it. Where the
    job started again (its ranks restarted), it resolves, saying so; where the job ended, it stays
    open (someone must see the job died), and so does a hardware class's after a restart (its host
    needs checking before it runs again) until a person resolves it."""
    attempt = t.evidence.get("attempt", "?")
    what = (
        f"{ENDED_AFTER} attempt {attempt} failed"
        if ended
        else f"attempt {attempt} ended and the job started again"
    )
    if any(e.reason.startswith(what) for e in t.events):
        return None
    if not ended and t.evidence.get("class") not in HARDWARE:
        t.move(now_us, "resolved", what)
        return Change(t, "resolved")
    hosts = ", ".join(t.hosts) or "its host"
    t.events.append(
        Event(now_us, t.state, f"{what}; open until someone has checked {hosts}" if not ended else what)
    )
    t.updated_us = now_us
    return Change(t, "updated")
