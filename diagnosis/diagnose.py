"""Records in, findings out: the detectors (``diagnosis.detectors``) in their order, their rank
findings grouped by topology, ranked by confidence."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pandas as pd

from rankscope.wire import records
from rankscope.wire.errors import UsageError
from rankscope.wire.settings import check_numbers

from . import topology
from .data import JobData
from .detectors import DETECTORS, failure, hang, job_wide, link, straggler
from .findings import Diagnosis, Finding


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Each detector's settings, under its name (``detectors.DETECTORS``)."""

    failure: failure.Settings = field(default_factory=failure.Settings)
    """Why the job's attempts died (``detectors.failure``)."""
    hang: hang.Settings = field(default_factory=hang.Settings)
    """When the job is hung, and on whom it waits (``detectors.hang``)."""
    straggler: straggler.Settings = field(default_factory=straggler.Settings)
    """The ranks that hold the job back (``detectors.straggler``)."""
    link: link.Settings = field(default_factory=link.Settings)
    """Slow network links (``detectors.link``)."""
    job_wide: job_wide.Settings = field(default_factory=job_wide.Settings)
    """Every rank slower than the job's own start (``detectors.job_wide``)."""
    min_confidence: float = 0.3
    """Findings below this confidence are not reported."""

    def __post_init__(self) -> None:
        check_numbers(self)
        if self.min_confidence > 1:
            raise UsageError(f"Settings.min_confidence must be <= 1, got {self.min_confidence}")


def coverage_gaps(ranks: pd.DataFrame) -> list[str]:
    """What some ranks' hooks do not see, each gap once with the ranks it is on
    (``"DDP Net on world: not tracked (...) (ranks 0, 1)"``), from the rank records' ``coverage``."""
    if "coverage" not in ranks:
        return []
    on: dict[str, list[int]] = {}
    # By distinct coverage: most ranks of a job say the same (one by one is slow at 100,000 ranks).
    for coverage, rs in ranks.groupby(ranks["coverage"].astype(str))["rank"]:
        for gap in records.coverage_gaps(str(coverage)):
            on.setdefault(gap, []).extend(rs.astype(int).tolist())
    return [f"{gap} ({_ranks(rs)})" for gap, rs in sorted(on.items())]


def records_missing(missing: pd.DataFrame) -> str:
    """How many records some ranks' processes made and the store lacks (``"5 of 1,204 records
    (ranks 2, 3)"``); "" when none."""
    if missing.empty:
        return ""
    made, stored = int(missing["made"].sum()), int(missing["stored"].sum())
    return f"{made - stored:,} of {made:,} records ({_ranks(missing['rank'].astype(int).tolist())})"


def _ranks(ranks: list[int], most: int = 8) -> str:
    rs = sorted(set(ranks))
    said = ", ".join(map(str, rs[:most])) + (f" and {len(rs) - most} more" if len(rs) > most else "")
    return f"rank{'s' if len(rs) > 1 else ''} {said}"


def window_shares(ranks: pd.DataFrame, costs: pd.DataFrame) -> dict[int, float]:
    """Per rank, what its profiling windows cost (``costs``: ``rank, time_us, window_cost_us``, as a
    heartbeat says) as a share of its time from its start (its rank record: where the hook's budget
    starts counting) to that heartbeat."""
    if costs.empty or "window_cost_us" not in costs or "time_us" not in ranks:
        return {}
    start = dict(zip(ranks["rank"].astype(int), ranks["time_us"].astype(int), strict=True))
    return {
        r: cost / (t - start[r])
        for r, t, cost in zip(
            costs["rank"].astype(int), costs["time_us"], costs["window_cost_us"], strict=True
        )
        if r in start and t > start[r]
    }


def window_cost(data: JobData) -> float | None:
    """The most any rank's profiling windows cost it (:func:`window_shares`, at its latest
    heartbeat); None where no heartbeat says."""
    shares = window_shares(data.ranks, data.heartbeats)
    return round(max(shares.values()), 5) if shares else None


def diagnose(data: JobData, settings: Settings | None = None) -> Diagnosis:
    """Analyze one job's records; findings ranked by confidence (empty for a healthy job)."""
    s = settings or Settings()
    t0 = time.perf_counter()

    def run(alone: bool) -> list[Finding]:
        found: list[Finding] = []
        for d in DETECTORS:
            if d.alone == alone:
                mine = d.find(data, getattr(s, d.name))
                if mine and d.exclusive:
                    return mine
                found += mine
        return found

    found = topology.group(run(alone=False), data.ranks) or run(alone=True)
    # Why each attempt the job started again after died: beside what the job does now, not instead.
    found += failure.earlier(data, s.failure)
    found = sorted((f for f in found if f.confidence >= s.min_confidence), key=lambda f: -f.confidence)
    steps = data.steps["step"]
    analyzed = {
        "ranks": int(data.steps["rank"].nunique()) if not data.steps.empty else len(data.ranks),
        "steps": [int(steps.min()), int(steps.max())] if not steps.empty else [],
        "windows": int(data.spans()["window"].nunique()),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if (cost := window_cost(data)) is not None:
        analyzed["window_cost"] = cost
    if gaps := coverage_gaps(data.ranks):
        analyzed["coverage_gaps"] = gaps
    if lost := records_missing(data.missing):
        analyzed["records_missing"] = lost
    return Diagnosis(job=data.job, findings=found, analyzed=analyzed)
