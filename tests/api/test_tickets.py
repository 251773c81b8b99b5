"""The ticket rules, pure: findings and times in, ticket changes out."""

from __future__ import annotations

from typing import Any

import pytest

from rankscope.api.tickets import Ticket, TicketSettings, fingerprint, reconcile
from rankscope.diagnosis import Finding


def _finding(
    cause: str = "compute", ranks: tuple[int, ...] = (2,), scope: str = "rank", **ev: Any
) -> Finding:
    return Finding(
        cause=cause, ranks=list(ranks), hosts=["h1"], function="f", confidence=0.9, summary="s",
        evidence={"rank_value_ms": 15.0, "peer_median_ms": 10.0, "held_steps": 100, **ev}, scope=scope,
    )  # fmt: skip


def test_a_fault_that_returns_after_resolving_is_a_new_linked_occurrence() -> None:
    tickets: dict[str, Ticket] = {}
    rules, s = TicketSettings(resolve_after_s=30), 1_000_000
    assert [c.kind for c in reconcile(tickets, "j", [_finding()], 0, 8, rules)] == ["opened"]
    assert [c.kind for c in reconcile(tickets, "j", [_finding()], 10 * s, 8, rules)] == ["updated"]
    assert reconcile(tickets, "j", [], 20 * s, 8, rules) == []  # absent 10 s: not yet
    assert [c.kind for c in reconcile(tickets, "j", [], 41 * s, 8, rules)] == ["resolved"]
    (again,) = reconcile(tickets, "j", [_finding()], 50 * s, 8, rules)
    fp = fingerprint("j", _finding())
    assert again.kind == "opened" and again.ticket.id == f"{fp}-2" and again.ticket.previous == f"{fp}-1"
    assert "returned" in again.ticket.events[0].reason
    assert tickets[f"{fp}-1"].events[-1].reason == "healthy for 30 s"


def test_a_slowdown_opens_its_ticket_once_it_held_and_one_that_comes_and_goes_opens_none() -> None:
    """Prometheus's ``for``: a slowdown is watched until every diagnosis for ``open_after_s`` had
    it; one missing diagnosis starts it over. A hang opens its ticket at once."""
    tickets: dict[str, Ticket] = {}
    pending: dict[str, int] = {}
    rules, s = TicketSettings(open_after_s=15), 1_000_000

    def cycle(at_s: float, *findings: Finding) -> list[str]:
        return [
            c.kind for c in reconcile(tickets, "j", list(findings), int(at_s * s), 8, rules, pending=pending)
        ]

    assert cycle(0, _finding()) == [] and pending == {fingerprint("j", _finding()): 0}
    assert cycle(10, _finding()) == []
    assert cycle(12) == [] and pending == {}, "gone before it held: watched no longer"
    assert cycle(14, _finding()) == [] and cycle(24, _finding()) == []
    assert cycle(29, _finding()) == ["opened"] and pending == {}
    assert tickets[f"{fingerprint('j', _finding())}-1"].opened_us == 29 * s
    assert cycle(34, _finding()) == ["updated"]
    hang = _finding(cause="hang", stalled_for_s=40)
    assert cycle(39, hang) == ["opened"]
    assert cycle(40, _finding(ranks=(5,))) == [] and len(pending) == 1
    ended = reconcile(tickets, "j", [], 41 * s, 8, rules, ended=True, pending=pending)
    assert {c.kind for c in ended} == {"resolved"} and pending == {}, "an ended job watches nothing"


def test_a_job_wide_slowdown_pages_only_once_it_held_for_minutes() -> None:
    """A job-wide finding names no culprit, and a shared machine slows a healthy job's ranks alike
    for tens of seconds (the dp x pp soak's false ticket held 40 s): it is watched, not ticketed,
    until it held ``open_after_job_wide_s``; a rank's slowdown beside it opens as before."""
    tickets: dict[str, Ticket] = {}
    pending: dict[str, int] = {}
    rules, s = TicketSettings(), 1_000_000
    wide = _finding(cause="job_wide", ranks=(0, 1, 2, 3), scope="job")

    def cycle(at_s: float, *findings: Finding) -> list[str]:
        return [
            c.kind for c in reconcile(tickets, "j", list(findings), int(at_s * s), 8, rules, pending=pending)
        ]

    assert [cycle(t, wide) for t in range(0, 45, 5)] == [[]] * 9, "40 s: watched"
    assert cycle(50) == [] and pending == {}, "gone before it held"
    assert cycle(60, wide, _finding()) == [] and cycle(80, wide, _finding()) == ["opened"]
    assert cycle(355, wide, _finding()) == ["updated"]
    assert cycle(360, wide, _finding()) == ["opened", "updated"], "held 300 s: ticketed"
    assert {t.cause for t in tickets.values()} == {"job_wide", "compute"}


def test_a_failure_opens_a_critical_ticket_at_once_and_says_what_came_after_it() -> None:
    """A crash pages at once. A restart that worked resolves its ticket saying so, but a hardware
    class's stays open for someone to check the host; a job that ended after it keeps it open.
    Each attempt's failure is its own ticket."""
    s = 1_000_000

    def crash(klass: str) -> Finding:
        return _finding(cause="failure", **{"class": klass, "attempt": 0})

    for klass, restarted in (("code", "resolved"), ("gpu_hardware", "open")):
        tickets: dict[str, Ticket] = {}
        (c,) = reconcile(tickets, "j", [crash(klass)], 0, 8, pending={})
        assert (c.kind, c.ticket.severity) == ("opened", "critical")
        (c,) = reconcile(tickets, "j", [], 5 * s, 8, pending={})  # ranks started again: no finding
        assert c.ticket.state == restarted
        assert c.ticket.events[-1].reason.startswith("attempt 0 ended and the job started again")
        assert reconcile(tickets, "j", [], 10 * s, 8, pending={}) == [], "said once"
    # The diagnosis of a restarted job goes on saying why the attempt before died: the same.
    for klass, restarted in (("code", "resolved"), ("gpu_hardware", "open")):
        tickets = {}
        reconcile(tickets, "j", [crash(klass)], 0, 8, pending={})
        went_on = _finding(cause="failure", **{"class": klass, "attempt": 0, "started_again": True})
        reconcile(tickets, "j", [went_on], 5 * s, 8, pending={})
        (t,) = tickets.values()
        assert t.state == restarted
        assert t.events[-1].reason.startswith("attempt 0 ended and the job started again")
        later = reconcile(tickets, "j", [went_on], 10 * s, 8, pending={})
        assert len(tickets) == 1 and all(c.kind == "updated" for c in later), "said once, never reopened"
        assert reconcile(tickets, "j", [], 70 * s, 8, ended=True) == [], "the job's end is no news of it"
    # A service that first reads the job after its restart: the ticket opens and says so at once.
    tickets = {}
    went_on = _finding(cause="failure", **{"class": "code", "attempt": 0, "started_again": True})
    assert [c.kind for c in reconcile(tickets, "j", [went_on], 0, 8, pending={})] == ["opened", "resolved"]
    # Another attempt's failure of the same rank is another ticket.
    again = _finding(cause="failure", **{"class": "code", "attempt": 1})
    assert [c.kind for c in reconcile(tickets, "j", [went_on, again], 5 * s, 8, pending={})] == ["opened"]
    tickets = {}
    reconcile(tickets, "j", [crash("code")], 0, 8)
    (c,) = reconcile(tickets, "j", [], 70 * s, 8, ended=True)
    assert (c.ticket.state, c.ticket.events[-1].reason) == ("open", "the job ended after attempt 0 failed")
    assert reconcile(tickets, "j", [], 75 * s, 8, ended=True) == []
    assert not c.ticket.waits_for_end, "the service leaves it to a person"


def test_a_host_ticket_absorbs_the_rank_tickets_it_explains() -> None:
    tickets: dict[str, Ticket] = {}
    reconcile(tickets, "j", [_finding(ranks=(8,)), _finding(ranks=(3,))], 0, 16)
    host = _finding(ranks=tuple(range(8, 16)), scope="host", host="node1")
    changes = reconcile(tickets, "j", [host, _finding(ranks=(3,))], 1, 16)
    kinds = {(c.ticket.culprit, c.kind) for c in changes}
    assert kinds == {("host node1", "opened"), ("ranks 8", "resolved"), ("ranks 3", "updated")}
    assert "absorbed by" in next(t for t in tickets.values() if t.culprit == "ranks 8").events[-1].reason


def test_severity_is_the_time_the_waiting_ranks_lost() -> None:
    tickets: dict[str, Ticket] = {}
    (c,) = reconcile(tickets, "j", [_finding()], 0, 8)
    assert c.ticket.lost_rank_s == pytest.approx(5e-3 * 100 * 7) and c.ticket.severity == "minor"
    (c,) = reconcile(tickets, "j", [_finding(held_steps=2e5)], 1, 8)
    assert c.ticket.severity == "critical"  # 5 ms x 200,000 steps x 7 ranks > 1 rank-hour
    hang = _finding(cause="hang", stalled_for_s=40)
    assert reconcile({}, "j", [hang], 0, 8)[0].ticket.severity == "critical"


def test_ticket_ids_depend_on_the_findings_alone() -> None:
    a: dict[str, Ticket] = {}
    b: dict[str, Ticket] = {}
    reconcile(a, "j", [_finding()], 5, 8)
    reconcile(b, "j", [_finding()], 9, 8)
    assert list(a) == list(b)  # two services diagnosing one job name its ticket alike
