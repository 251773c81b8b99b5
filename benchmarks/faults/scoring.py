"""Score a diagnosis against the ground truth of an injected fault: right culprit, right cause, how fast.

Pure functions over :class:`diagnosis.Diagnosis`, shared by the real-job fault suite
(``benchmarks/faults/suite.py``) and any synthetic benchmark::

    truth = GroundTruth(kind="compute", cause="compute", ranks=(2,))
    s = score(truth, diagnose(data), name="compute-2x-r2")
    s.top_correct, s.false_findings
    totals([s, ...])  # top1_accuracy, precision, recall, healthy_false_findings

A finding is *correct* when its cause is the injected one and it names exactly the faulty ranks
(for a host or switch fault: all the ranks behind it; for a job-wide slowdown: cause ``job_wide``).
It is *located* when only the ranks are right. Every finding on a healthy run is a false finding,
unless the harness measured the machine itself slow down during the run (``benchmarks/machine.py``):
then the job really did slow down, as a whole (``job_wide``) or, where the machine slowed some
cores more than others (a busy hyperthread sibling on the host, a core clocked down), on the ranks
those cores ran. Such findings are counted apart as *explained*: the harness cannot tell which
ranks its slower machine hit, so it neither credits nor blames them.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from rankscope.diagnosis.findings import CAUSES, Diagnosis, Finding

SCOPES = ("rank", "link", "host", "switch", "spine", "job")


@dataclass(frozen=True, slots=True, kw_only=True)
class GroundTruth:
    kind: str
    """The injected fault kind (``none`` for a healthy run); groups scenarios in the report."""
    cause: str | None = None
    """The cause a correct finding names; None for a healthy run (no finding is correct)."""
    ranks: tuple[int, ...] = ()
    """The faulty ranks (all ranks for a job-wide fault)."""
    scope: str = "rank"
    """``rank``, ``host``, ``switch`` or ``job``: what the faulty ranks have in common."""
    where: str = ""
    """The host or switch name for scope ``host`` / ``switch``."""
    function: tuple[str, ...] = ()
    """Texts, one of which the top finding's function must contain to name the right code (user
    code: the function's name; a slower device: also its operators as a whole); none where the
    scenario does not say."""
    also: GroundTruth | None = None
    """A second fault injected at the same time: a finding naming either one is right."""

    def __post_init__(self) -> None:
        if self.cause is not None and self.cause not in CAUSES:
            raise ValueError(f"GroundTruth.cause must be one of {CAUSES} or None, got {self.cause!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"GroundTruth.scope must be one of {SCOPES}, got {self.scope!r}")
        if self.cause is not None and self.cause != "job_wide" and not self.ranks:
            raise ValueError("GroundTruth.ranks must name the faulty ranks")

    @property
    def healthy(self) -> bool:
        return self.cause is None


def located(truth: GroundTruth, f: Finding) -> bool:
    """The finding names the faulty ranks (whatever its cause), of either fault if two."""
    if truth.healthy:
        return False
    if truth.also is not None and located(truth.also, f):
        return True
    if truth.scope == "job":
        return f.scope == "job" or (bool(truth.ranks) and set(f.ranks) == set(truth.ranks))
    return set(f.ranks) == set(truth.ranks)


def correct(truth: GroundTruth, f: Finding) -> bool:
    """The finding names the faulty ranks and the injected cause (of either fault, if two)."""
    if truth.also is not None and correct(truth.also, f):
        return True
    return located(replace(truth, also=None), f) and f.cause == truth.cause


def companion(truth: GroundTruth, f: Finding) -> bool:
    """A false extra finding: it names a rank (a host, a link: the ranks behind them) that is no
    culprit, or the whole job where the fault is not job-wide. A finding on a culprit that gets its
    cause wrong is wrong, but no companion; on a healthy run every finding is one."""
    if truth.healthy:
        return True
    truths = [t for t in (truth, truth.also) if t is not None]
    if f.scope == "job":
        return not any(t.scope == "job" for t in truths)
    return not set(f.ranks) <= {r for t in truths for r in t.ranks}


def function_ok(truth: GroundTruth, f: Finding | None) -> bool | None:
    """The finding is right and names the expected function (None: the scenario expects none, or
    the fault it names is the one of two that expects none)."""
    if not truth.function and (truth.also is None or not truth.also.function):
        return None
    if f is None:
        return False
    for t in (replace(truth, also=None), truth.also):
        if t is not None and located(t, f) and f.cause == t.cause:
            return any(text in f.function for text in t.function) if t.function else None
    return False


@dataclass(frozen=True, slots=True, kw_only=True)
class Score:
    name: str
    kind: str
    healthy: bool
    expected: str
    """The ground truth in words: ``compute @ ranks [2]``."""
    findings: int
    top: str
    """The top finding in words ('' when there is none)."""
    top_correct: bool
    top_located: bool
    any_correct: bool
    confidence: float
    """The top finding's confidence (0 without findings)."""
    correct_findings: int
    false_findings: int
    """Findings that do not match the ground truth (every finding on a healthy run but those
    ``explained``)."""
    explained: int = 0
    """Healthy run on a machine that slowed down: its findings, which the slowdown explains."""
    companions: int = 0
    """False extra findings (:func:`companion`), less those ``explained``."""
    function: str = ""
    """The function the top finding names."""
    function_ok: bool | None = None
    """It names the expected function (None where the scenario expects none)."""
    both_found: bool | None = None
    """Two faults: a right finding for each (None with one fault)."""
    detail: list[dict[str, Any]] = field(default_factory=list)
    """Every finding: cause, ranks, hosts, scope, function, confidence, summary."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe(f: Finding) -> str:
    where = f"{f.scope} {','.join(f.hosts)}" if f.scope in ("host", "switch", "spine") else f"ranks {f.ranks}"
    if f.scope == "job":
        where = "job"
    return f"{f.cause} @ {where}"


def expected(truth: GroundTruth) -> str:
    if truth.healthy:
        return "no finding"
    where = f"{truth.scope} {truth.where} " if truth.where else ""
    out = f"{truth.cause} @ {where}ranks {list(truth.ranks)}" if truth.ranks else f"{truth.cause} @ job"
    return out if truth.also is None else f"{out} + {expected(truth.also)}"


def score(truth: GroundTruth, diagnosis: Diagnosis, *, name: str = "", machine_slowed: bool = False) -> Score:
    """How the diagnosis of one run compares to the fault injected into it (``machine_slowed``:
    the harness measured the machine itself slow down during the run)."""
    fs = diagnosis.findings
    top = fs[0] if fs else None
    ok = [correct(truth, f) for f in fs]
    explained = len(fs) if truth.healthy and machine_slowed else 0
    return Score(
        name=name or diagnosis.job,
        kind=truth.kind,
        healthy=truth.healthy,
        expected=expected(truth),
        findings=len(fs),
        top=describe(top) if top else "",
        top_correct=bool(top is not None and ok[0]),
        top_located=bool(top is not None and located(truth, top)),
        any_correct=any(ok),
        confidence=float(top.confidence) if top else 0.0,
        correct_findings=sum(ok),
        false_findings=len(fs) - sum(ok) - explained,
        explained=explained,
        companions=sum(companion(truth, f) for f in fs) - explained,
        function=top.function if top else "",
        function_ok=function_ok(truth, top),
        both_found=(
            None
            if truth.also is None
            else any(correct(replace(truth, also=None), f) for f in fs)
            and any(correct(truth.also, f) for f in fs)
        ),
        detail=[
            {
                "cause": f.cause,
                "ranks": list(f.ranks),
                "hosts": list(f.hosts),
                "scope": f.scope,
                "function": f.function,
                "confidence": f.confidence,
                "summary": f.summary,
            }
            for f in fs
        ],
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Probe:
    """The diagnosis of the data as it stood ``after_s`` seconds (``after_steps`` steps) after onset
    (a healthy run's: after its start); negative before the onset."""

    after_s: float
    after_steps: int
    diagnosis: Diagnosis


@dataclass(frozen=True, slots=True, kw_only=True)
class Delays:
    """Time from fault onset until the diagnosis first saw something, first named the culprit, and
    named it for good: as ``rankscope serve`` diagnoses a running job, every cycle counts."""

    detect_s: float | None = None
    """First time after onset with any finding (None: never within the run)."""
    detect_steps: int | None = None
    localize_s: float | None = None
    """First time after onset at which the top finding was correct (ranks and cause)."""
    localize_steps: int | None = None
    stable_s: float | None = None
    """The time after onset from which the top finding is correct at every probe to the end of the
    run (None: not right at the end)."""
    stable_steps: int | None = None
    flaps: int = 0
    """Times a correct top finding was lost again at a later probe."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Alarms:
    """False alarms at the probes where any finding is one: every probe of a healthy run, the
    probes of a fault run before its onset; and after the onset, findings on ranks that are no
    culprit (:func:`companion`)."""

    probes: int = 0
    """Probes where any finding is false: a healthy run's all, a fault run's before the onset."""
    false: int = 0
    """Of those, probes with a finding."""
    first_s: float | None = None
    """The first of those probes' time (after onset: negative before it)."""
    top_confidence: float = 0.0
    """The highest confidence of a false finding at those probes."""
    extra: int = 0
    """Probes after the onset with a finding on a rank that is no culprit."""
    excused: bool = False
    """The harness measured the machine itself slow down during the run (see :func:`score`): its
    false alarms are reported, and counted apart."""
    tickets: int = 0
    """Tickets ``rankscope serve`` would have opened over the probes (its ticket rules)..."""
    false_tickets: int = 0
    """...on a healthy run, before the onset, or on a rank that is no culprit: someone paged for nothing."""
    reopened: int = 0
    """Right tickets opened again after they resolved while the fault lasted (a flapping ticket)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def delays(truth: GroundTruth, probes: Sequence[Probe]) -> Delays:
    """Detection, localization and time-to-stable localization from diagnoses of the data cut at
    increasing times (those before the onset play no part)."""
    after = [p for p in probes if p.after_s > 0]
    if truth.healthy or not after:
        return Delays()
    right = [bool(p.diagnosis.findings) and correct(truth, p.diagnosis.findings[0]) for p in after]
    detect = next((p for p in after if p.diagnosis.findings), None)
    localize = next((p for p, ok in zip(after, right, strict=True) if ok), None)
    stable = None
    for p, ok in zip(reversed(after), reversed(right), strict=True):
        if not ok:
            break
        stable = p
    return Delays(
        detect_s=detect.after_s if detect else None,
        detect_steps=detect.after_steps if detect else None,
        localize_s=localize.after_s if localize else None,
        localize_steps=localize.after_steps if localize else None,
        stable_s=stable.after_s if stable else None,
        stable_steps=stable.after_steps if stable else None,
        flaps=sum(a and not b for a, b in itertools.pairwise(right)),
    )


def false_ticket(truth: GroundTruth, at_s: float, f: Finding) -> bool:
    """A ticket opened ``at_s`` after the onset on finding ``f`` pages someone for nothing: on a
    healthy run, before the onset, or on a rank, host or link that is no culprit."""
    return truth.healthy or at_s <= 0 or companion(truth, f)


def alarms(
    truth: GroundTruth,
    probes: Sequence[Probe],
    *,
    machine_slowed: bool = False,
    opened: Sequence[tuple[float, Finding]] = (),
) -> Alarms:
    """The false alarms of a run's probes (``machine_slowed``: as in :func:`score`; ``opened``: the
    time and finding of each ticket the service's rules open over the same probes)."""
    right = [f for at, f in opened if not false_ticket(truth, at, f)]
    kinds = [(f.cause, f.scope, tuple(f.ranks)) for f in right]
    watched = [p for p in probes if truth.healthy or p.after_s <= 0]
    false = [p for p in watched if p.diagnosis.findings]
    extra = [
        p
        for p in probes
        if not truth.healthy and p.after_s > 0 and any(companion(truth, f) for f in p.diagnosis.findings)
    ]
    return Alarms(
        probes=len(watched),
        false=len(false),
        first_s=false[0].after_s if false else None,
        top_confidence=max((f.confidence for p in false for f in p.diagnosis.findings), default=0.0),
        extra=len(extra),
        excused=machine_slowed and bool(false),
        tickets=len(opened),
        false_tickets=sum(false_ticket(truth, at, f) for at, f in opened),
        reopened=len(kinds) - len(set(kinds)),
    )


def _ratio(num: int, den: int) -> float | None:
    return round(num / den, 4) if den else None


def _median(values: Iterable[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return round(statistics.median(xs), 2) if xs else None


def totals(
    scores: Sequence[Score], timings: Sequence[Delays] | None = None, alarmed: Sequence[Alarms] | None = None
) -> dict[str, Any]:
    """Suite totals: ``top1_accuracy`` (fault runs whose top finding is right), ``precision`` (right
    findings / all findings, healthy runs included), ``recall`` (fault runs with a right finding
    anywhere in the list), ``healthy_false_findings`` (findings on healthy runs, all wrong but
    those the machine's own slowdown explains), ``false_extra_findings`` (findings on a rank, host
    or link that is no culprit, healthy runs included: the target is 0)."""
    faults = [s for s in scores if not s.healthy]
    healthy = [s for s in scores if s.healthy]
    all_findings = sum(s.findings - s.explained for s in scores)
    out: dict[str, Any] = {
        "scenarios": len(scores),
        "fault_scenarios": len(faults),
        "healthy_scenarios": len(healthy),
        "top1_accuracy": _ratio(sum(s.top_correct for s in faults), len(faults)),
        "top1_located": _ratio(sum(s.top_located for s in faults), len(faults)),
        "precision": _ratio(sum(s.correct_findings for s in scores), all_findings),
        "recall": _ratio(sum(s.any_correct for s in faults), len(faults)),
        "healthy_false_findings": sum(s.false_findings for s in healthy),
        "false_extra_findings": sum(s.companions for s in scores),
        "healthy_explained_findings": sum(s.explained for s in healthy),
    }
    named = [s.function_ok for s in faults if s.function_ok is not None]
    out["function_accuracy"] = _ratio(sum(named), len(named))
    if timings is not None:
        ts = [t for s, t in zip(scores, timings, strict=True) if not s.healthy]
        out["median_detect_s"] = _median(t.detect_s for t in ts)
        out["median_localize_s"] = _median(t.localize_s for t in ts)
        out["p90_localize_s"] = _quantile([t.localize_s for t in ts], 0.9)
        # The two targets apart: a slowdown's root cause, and a hang (declared after
        # ``HangSettings.stall_s`` without progress, 30 s: not earlier than that).
        pairs = [(s, t) for s, t in zip(scores, timings, strict=True) if not s.healthy]
        slow = [t.localize_s for s, t in pairs if not s.kind.startswith("hang")]
        hung = [t.localize_s for s, t in pairs if s.kind.startswith("hang")]
        out["p90_localize_slowdowns_s"] = _quantile(slow, 0.9)
        out["max_localize_hangs_s"] = _quantile(hung, 1.0)
        out["median_stable_s"] = _median(t.stable_s for t in ts)
        out["p90_stable_s"] = _quantile([t.stable_s for t in ts], 0.9)
        out["flapping_runs"] = sum(t.flaps > 0 for t in ts)
    if alarmed is not None:
        # As the service runs: every probe where a finding would be a false alarm, raw and with
        # the runs on a machine measured to slow down set apart (never instead).
        out["alarm_probes"] = sum(a.probes for a in alarmed)
        out["false_alarm_probes"] = sum(a.false for a in alarmed)
        out["false_alarm_runs"] = sum(a.false > 0 for a in alarmed)
        out["false_alarm_runs_excused"] = sum(a.excused for a in alarmed)
        out["false_extra_probes"] = sum(a.extra for a in alarmed)
        out["false_tickets"] = sum(a.false_tickets for a in alarmed)
        out["false_ticket_runs"] = sum(a.false_tickets > 0 for a in alarmed)
        out["reopened_tickets"] = sum(a.reopened for a in alarmed)
    return out


def _quantile(values: Sequence[float | None], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) where a fault never localized counts as infinitely late."""
    xs = sorted(math.inf if v is None else v for v in values)
    if not xs:
        return None
    v = xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)]
    return None if math.isinf(v) else round(v, 2)


def by_kind(scores: Sequence[Score], timings: Sequence[Delays]) -> dict[str, dict[str, Any]]:
    """Per fault kind: runs, top findings right, located, median delays, false findings."""
    groups: dict[str, list[tuple[Score, Delays]]] = defaultdict(list)
    for s, t in zip(scores, timings, strict=True):
        groups[s.kind].append((s, t))
    return {
        kind: {
            "runs": len(g),
            "top_correct": sum(s.top_correct for s, _ in g),
            "top_located": sum(s.top_located for s, _ in g),
            "false_findings": sum(s.false_findings for s, _ in g),
            "companions": sum(s.companions for s, _ in g),
            "function_ok": sum(bool(s.function_ok) for s, _ in g),
            "function_expected": sum(s.function_ok is not None for s, _ in g),
            "median_detect_s": _median(t.detect_s for _, t in g),
            "median_localize_s": _median(t.localize_s for _, t in g),
        }
        for kind, g in sorted(groups.items())
    }
