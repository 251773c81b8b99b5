"""A job's effective training time ratio (ETTR), measured from its records, and what it would be.

ETTR = productive training time / wall-clock time (Meta, arXiv 2410.21680). The wall clock runs
from the job's first attach to its last step; every second of it is put in one bucket:

``productive``  step time up to the job's own healthy pace (``baseline_step_s``);
``startup``     the first attempt's first step beyond that pace: its first step runs from the
                attach on (building the model and the process group, the first batch);
``slowdown``    step time beyond that pace (stragglers, contention, jitter);
``hang``        steps that took ``stall_s`` or more beyond it, and an attempt's last minutes in
                which its ranks were alive (heartbeats) but made no progress;
``checkpoint``  the part of steps spent inside ``Hook.checkpoint()`` saves;
``restart``     from an attempt's last progress to the next attempt's first step (detection,
                rescheduling, start-up), that first step beyond the pace, and its checkpoint loads
                (the first attempt's count as ``startup``);
``redo``        work an attempt did that the next one did again: from the step it resumed at to
                the failed attempt's last progress;
``other``       the rest (the hook paused, gaps between steps).

Attempts are the ranks' starts (``rank`` records: torchrun's restarts, or any relaunch). The steps
of one rank (the lowest) stand for the job's: in synchronous training every rank's step takes the
job's step time. Its heartbeats (every few seconds) tell how far a failed attempt got beyond the
steps it shipped; the store keeps the later attempt's rows of a step it redid.

The projection uses :mod:`diagnosis.reliability` with the job's measured restart time, checkpoint
interval and write time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import pandas as pd

from rankscope.wire.errors import NotFoundError

from . import reliability
from .detectors import failure

CAUSES = ("startup", "slowdown", "hang", "checkpoint", "restart", "redo", "other")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunRecords:
    """What the measurement reads of a job (``read_run`` fills it from a store)."""

    job: str
    rank: int
    """The rank whose steps and heartbeats stand for the job's."""
    steps: pd.DataFrame
    """That rank's steps: ``step, start_us, dur_us``."""
    attempts: pd.DataFrame
    """Every start of every rank: ``rank, host, attempt, time_us``."""
    checkpoints: pd.DataFrame
    """One row per checkpoint: ``kind, step, start_us, end_us, dur_us``."""
    progress: pd.DataFrame
    """That rank's heartbeats: ``time_us, step, progress_age_s``."""
    exits: pd.DataFrame = field(default_factory=pd.DataFrame)
    """How each rank's process ended (``Reads.exits``): which rank failed each attempt, and why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Attempt:
    number: int
    start_s: float
    """Seconds from the job's first start."""
    first_step: int
    """-1: it made no step."""
    last_step: int
    """The last step it finished (from its steps and heartbeats)."""
    redone_steps: int = 0
    """Steps of this attempt that the next one did again."""
    redo_s: float = 0.0
    hang_s: float = 0.0
    """Its ranks alive without progress before it ended."""
    restart_s: float = 0.0
    """From its last progress until the next attempt runs at pace: to its first step, and that
    step beyond the pace (0 for the last attempt)."""
    failed_rank: int = -1
    """The rank that failed it first (``detectors.failure``), -1 if none said so."""
    failed_host: str = ""
    failure: str = ""
    """Its error's class (``detectors.failure.CLASSES``: ``gpu_hardware``, ``code``...); ``unknown``
    for an attempt followed by another without a rank's word on why; '' for one that did not fail."""
    error: str = ""
    """The exception, ``Error: message`` (its first 200 characters)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Reliability:
    job: str
    wall_s: float
    productive_s: float
    ettr: float
    lost_s: dict[str, float]
    """Seconds lost per cause (``CAUSES``); with ``productive_s`` they add up to ``wall_s``."""
    baseline_step_s: float
    steps: int
    """Distinct steps trained."""
    nodes: int
    attempts: list[Attempt]
    saves: int
    loads: int
    write_s: float | None
    """Median time a checkpoint save blocked training."""
    interval_s: float | None
    """Median time between the starts of consecutive saves."""
    restart_s: float | None
    """Median restart time (u0) measured, or the one given."""
    failures_per_node_day: float
    mttf_s: float
    """Projected at the job's node count: 1 / (N·r_f)."""
    expected_ettr: float | None
    """E[ETTR] at the measured restart time, checkpoint interval and write time."""
    optimal_interval_s: float | None
    lost_by_failure: dict[str, float] = field(default_factory=dict)
    """Seconds the failed attempts lost (redone work, hang, restart), per failure class."""
    failures: dict[str, int] = field(default_factory=dict)
    """Failed attempts per failure class."""
    notes: list[str] = field(default_factory=list)
    """What could not be measured, said plainly."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RunReader(Protocol):
    """What :func:`read_run` needs of a store (``aggregator.Store`` has it)."""

    def attempts(self, job: str) -> pd.DataFrame: ...
    def steps(
        self, job: str, since_step: int | None = None, since_us: int | None = None, rank: int | None = None
    ) -> pd.DataFrame: ...
    def checkpoints(self, job: str) -> pd.DataFrame: ...
    def progress(self, job: str, rank: int) -> pd.DataFrame: ...
    def exits(self, job: str) -> pd.DataFrame: ...


def read_run(store: RunReader, job: str) -> RunRecords:
    attempts = store.attempts(job)
    rank = int(attempts["rank"].min()) if not attempts.empty else 0
    return RunRecords(
        job=job,
        rank=rank,
        steps=store.steps(job, rank=rank),
        attempts=attempts,
        checkpoints=store.checkpoints(job),
        progress=store.progress(job, rank),
        exits=store.exits(job),
    )


def _baseline_us(dur: np.ndarray, chunk: int = 20) -> float:
    """The job's healthy pace: the 10th percentile of the medians of consecutive ``chunk``-step runs
    (the median over all steps if there are fewer)."""
    if dur.size < 2 * chunk:
        return float(np.median(dur))
    n = dur.size // chunk
    return float(np.percentile(np.median(dur[: n * chunk].reshape(n, chunk), axis=1), 10))


def _overlap_us(lo: np.ndarray, hi: np.ndarray, intervals: pd.DataFrame) -> np.ndarray:
    """Per step ``[lo, hi)``, how much of it the ``start_us, end_us`` intervals cover."""
    out = np.zeros(lo.size)
    for a, b in intervals[["start_us", "end_us"]].to_numpy(dtype=np.float64):
        out += np.clip(np.minimum(hi, b) - np.maximum(lo, a), 0, None)
    return np.minimum(out, hi - lo)


def measure(
    run: RunRecords,
    *,
    failures_per_node_day: float = reliability.FAILURES_PER_NODE_DAY,
    restart_s: float | None = None,
    stall_s: float = 10.0,
) -> Reliability:
    """The job's ETTR and its lost time by cause, its attempts, and the projection (``restart_s``:
    the restart time to project with when the job had none; a measured one wins)."""
    notes: list[str] = []
    steps = run.steps.sort_values("start_us")
    if steps.empty:
        raise NotFoundError(f"job {run.job!r} has no steps of rank {run.rank}: nothing to measure")
    mine = run.attempts[run.attempts["rank"] == run.rank]
    starts = np.sort(mine["time_us"].to_numpy(dtype=np.float64)) if not mine.empty else np.zeros(0)
    first_us = float(steps["start_us"].min())
    # The first start is the job's, whenever its first step began: earlier hooks stamped their
    # ``rank`` record after the attach's warm-up, when the first step had begun already.
    starts = np.concatenate([[min(starts[0], first_us)], starts[1:]]) if starts.size else np.array([first_us])
    begin = np.minimum(starts[0], first_us)

    step = steps["step"].to_numpy(dtype=np.int64)
    lo = steps["start_us"].to_numpy(dtype=np.float64)
    dur = steps["dur_us"].to_numpy(dtype=np.float64)
    hi = lo + dur
    which = np.clip(np.searchsorted(starts, lo, side="right") - 1, 0, None)
    beats = run.progress
    beat_t = beats["time_us"].to_numpy(dtype=np.float64)
    beat_which = np.searchsorted(starts, beat_t, side="right") - 1

    ck = run.checkpoints
    saves, loads = ck[ck["kind"] == "save"], ck[ck["kind"] == "load"]
    in_save, in_load = _overlap_us(lo, hi, saves), _overlap_us(lo, hi, loads)
    rest = dur - in_save - in_load
    base = _baseline_us(rest)
    excess = np.clip(rest - base, 0, None)
    # An attempt's first step runs from the attach on: building the model, the process group,
    # the first batch. Beyond the pace, that is start-up (a restart's, after the first attempt).
    opening = np.zeros(step.size, dtype=bool)
    for k in np.unique(which):
        opening[np.flatnonzero(which == k)[np.argmin(lo[which == k])]] = True
    stalled = (excess >= stall_s * 1e6) & ~opening
    lost = dict.fromkeys(CAUSES, 0.0)
    lost["slowdown"] = float(excess[~stalled & ~opening].sum())
    lost["hang"] = float(excess[stalled].sum())
    lost["checkpoint"] = float(in_save.sum())
    # Per attempt, its start-up beyond the gap before it: the first step's excess and checkpoint loads.
    start_up = {
        int(k): float(excess[opening & (which == k)].sum() + in_load[which == k].sum())
        for k in np.unique(which)
    }
    lost["startup"] = start_up.pop(0, 0.0) + float(lo[0] - begin)
    lost["restart"] = sum(start_up.values())
    productive = float((rest - excess).sum())

    beat_step = beats["step"].to_numpy(dtype=np.int64)
    beat_age = beats["progress_age_s"].to_numpy(dtype=np.float64)
    spans = []  # per attempt: first step, last step, time of its last progress, last sign of life
    for k in range(starts.size):
        own, b = which == k, beat_which == k
        first = int(step[own].min()) if own.any() else -1
        last = int(step[own].max()) if own.any() else -1
        end = float(hi[own].max()) if own.any() else float(starts[k])
        if b.any() and int(beat_step[b].max()) > last:  # it got further than the steps it shipped
            last = int(beat_step[b].max())  # a heartbeat's step: the last one the rank finished
            at = b & (beat_step == last)
            end = max(end, float((beat_t[at] - beat_age[at] * 1e6).min()))
        alive = max(end, float(beat_t[b].max())) if b.any() else end
        spans.append((first, last, end, alive))
    attempts = []
    for k, (first, last, end, alive) in enumerate(spans):
        # A failed attempt: what the next one redid, how long it hung, how long the restart took.
        nxt = next((j for j in range(k + 1, len(spans)) if spans[j][0] >= 0), None)
        redone, redo, hang, restart = 0, 0.0, 0.0, 0.0
        if first < 0:
            pass  # no step: its time lies within the restart before the next attempt's first step
        elif nxt is None:
            hang = alive - end if alive - end >= stall_s * 1e6 else 0.0  # hung now, or at the end
        else:
            resumed = spans[nxt][0]
            next_lo = float(lo[(which == nxt) & (step == resumed)].min())
            if last >= resumed:
                redone = last - resumed + 1
                before = (which == k) & (step == resumed - 1)  # its last step the next one kept
                redo = max(
                    0.0, end - (float(hi[before].max()) if before.any() else float(lo[which == k].min()))
                )
                redone = redone if redo > 0 else 0
            hang = alive - end if alive - end >= stall_s * 1e6 else 0.0
            restart = max(0.0, next_lo - end - hang)
            lost["restart"] += restart
            restart += start_up.get(nxt, 0.0)
        attempts.append(
            Attempt(
                number=k,
                start_s=round((starts[k] - begin) / 1e6, 3),
                first_step=first,
                last_step=last,
                redone_steps=redone,
                redo_s=round(max(redo, 0.0) / 1e6, 3),
                hang_s=round(hang / 1e6, 3),
                restart_s=round(restart / 1e6, 3),
            )
        )
        lost["redo"] += max(redo, 0.0)
        lost["hang"] += hang
    attempts = _failures(attempts, run, starts)

    wall = max(float(hi.max()), spans[-1][3]) - begin
    lost["other"] = max(0.0, wall - productive - sum(lost.values()))
    by_class: dict[str, float] = {}
    failures: dict[str, int] = {}
    for a in attempts:
        if a.failure:
            by_class[a.failure] = round(by_class.get(a.failure, 0.0) + a.redo_s + a.hang_s + a.restart_s, 3)
            failures[a.failure] = failures.get(a.failure, 0) + 1
    if len(attempts) > 1 and run.exits.empty:
        notes.append(
            "no rank said how its process ended (hooks before exit records): the failures' causes are unknown"
        )
    restarts = [a.restart_s for a in attempts[:-1] if a.restart_s > 0]
    measured_u0 = float(np.median(restarts)) if restarts else None
    u0 = measured_u0 if measured_u0 is not None else restart_s
    write = float(np.median(saves["dur_us"])) / 1e6 if not saves.empty else None
    gaps = np.diff(np.sort(saves["start_us"].to_numpy(dtype=np.float64))) / 1e6
    interval = float(np.median(gaps)) if gaps.size else None
    nodes = max(1, int(run.attempts["host"].nunique())) if not run.attempts.empty else 1
    if saves.empty:
        notes.append("no checkpoints seen (time them with hook.checkpoint()): a failure would lose all work")
    elif interval is None:
        notes.append("one checkpoint seen: no interval between checkpoints to measure")
    if len(attempts) == 1:
        notes.append(
            "no restarts seen" + ("" if restart_s is None else f": projected with u0 = {restart_s:g} s")
        )
    shape = None
    if interval is not None and write is not None and u0 is not None:
        shape = reliability.JobShape(
            nodes=nodes,
            restart_s=u0,
            interval_s=interval,
            write_s=write,
            failures_per_node_day=failures_per_node_day,
        )
    elif u0 is None:
        notes.append("no restart time to project with (none seen; give one)")
    rate = reliability.JobShape(
        nodes=nodes, restart_s=0, interval_s=1, write_s=0, failures_per_node_day=failures_per_node_day
    )
    return Reliability(
        job=run.job,
        wall_s=round(wall / 1e6, 3),
        productive_s=round(productive / 1e6, 3),
        ettr=round(productive / wall, 4) if wall > 0 else 0.0,
        lost_s={c: round(v / 1e6, 3) for c, v in lost.items()},
        baseline_step_s=round(base / 1e6, 6),
        steps=int(np.unique(step).size),
        nodes=nodes,
        attempts=attempts,
        saves=len(saves),
        loads=len(loads),
        write_s=write,
        interval_s=interval,
        restart_s=u0,
        failures_per_node_day=failures_per_node_day,
        mttf_s=reliability.mttf_s(rate),
        expected_ettr=reliability.expected_ettr(shape) if shape else None,
        optimal_interval_s=reliability.optimal_interval_s(shape) if shape and write else None,
        lost_by_failure=by_class,
        failures=failures,
        notes=notes,
    )


def _failures(attempts: list[Attempt], run: RunRecords, starts: np.ndarray) -> list[Attempt]:
    """Each attempt with the rank that failed it first and its error's class, from the exit
    records sent within it (by time: a record belongs to the latest attempt started before it). A
    rank of an attempt that another followed and that sent no exit record ended without a word
    (SIGKILL, the OOM killer, a node lost): where no rank raised an error of its own, it is the one."""

    def attempt_of(frame: pd.DataFrame) -> np.ndarray:
        if frame.empty:
            return np.zeros(0, dtype=np.int64)
        # A rank's start can come a little before the lowest rank's: the same attempt.
        return np.clip(
            np.searchsorted(starts, frame["time_us"].to_numpy(dtype=np.float64), side="right") - 1, 0, None
        )

    exits, began = run.exits, run.attempts
    ended_in, began_in = attempt_of(exits), attempt_of(began)

    def host(rank: int, k: int) -> str:
        mine = began[(began_in == k) & (began["rank"] == rank)]
        return str(mine["host"].iloc[-1]) if not mine.empty else ""

    out = []
    for k, a in enumerate(attempts):
        ended = exits[ended_in == k]
        followed = k < len(attempts) - 1
        said = set(ended["rank"].astype(int)) if not ended.empty else set()
        quiet = (
            set(began.loc[began_in == k, "rank"].astype(int)) - said
            if followed and not ended.empty
            else set()
        )
        first = failure.first_failed(ended, dict.fromkeys(quiet, 1 << 62)) if not ended.empty else None
        if first is not None:
            _, rank, row = first
            # Of ranks that all ended without a word, which went first none can tell.
            who = rank if row is not None or len(quiet) == 1 else -1
            klass, _, what = failure.explain(row)
            a = replace(a, failed_rank=who, failed_host=host(who, k), failure=klass, error=what[:200])
        elif followed:
            a = replace(a, failure="unknown")  # another attempt followed, without a word on why
        out.append(a)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class FailingHost:
    host: str
    failures: dict[str, int]
    """Attempts it failed first, per failure class."""
    jobs: list[str]
    lemon: bool
    """It failed ``LEMON_FAILURES`` attempts or more with a hardware class: a lemon node."""
    preflight: str = ""
    """What its last preflight said (``passed``, or ``failed:`` and why), where a report was given;
    ``not in the reports`` where none held it."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


LEMON_FAILURES = 2
"""Hardware-class failures on one host that make it a lemon node (Meta's study finds lemons by
their repeated failures: a host that failed twice with a GPU fault is likely to again)."""


def failing_hosts(runs: list[Reliability]) -> list[FailingHost]:
    """The hosts whose ranks failed attempts first, over ``runs`` (a fleet's jobs), lemon nodes
    first, then by failures."""
    by_host: dict[str, tuple[dict[str, int], set[str]]] = {}
    for r in runs:
        for a in r.attempts:
            if a.failure and a.failed_host:
                classes, jobs = by_host.setdefault(a.failed_host, ({}, set()))
                classes[a.failure] = classes.get(a.failure, 0) + 1
                jobs.add(r.job)
    out = [
        FailingHost(
            host=h,
            failures=classes,
            jobs=sorted(jobs),
            lemon=sum(n for k, n in classes.items() if k in failure.HARDWARE) >= LEMON_FAILURES,
        )
        for h, (classes, jobs) in by_host.items()
    ]
    return sorted(out, key=lambda f: (not f.lemon, -sum(f.failures.values()), f.host))


@dataclass(frozen=True, slots=True, kw_only=True)
class FailureClass:
    failure: str
    failures: int
    """Failed attempts of this class over the fleet's jobs..."""
    node_days: float
    """...over their node-days (each job's nodes times its wall clock)..."""
    mttf_node_days: float
    """...so that one node runs this long, on average, before an attempt fails of it (the MTTF of
    a job of N nodes is this over N)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def failures_by_class(runs: list[Reliability]) -> list[FailureClass]:
    """The failed attempts over ``runs`` (a fleet's jobs) per failure class, most first, with the
    mean time to a failure of each class (Meta's reliability study reports MTTF per class)."""
    counts: dict[str, int] = {}
    for r in runs:
        for k, n in r.failures.items():
            counts[k] = counts.get(k, 0) + n
    node_days = _node_days(runs)
    out = [
        FailureClass(failure=k, failures=n, node_days=round(node_days, 9), mttf_node_days=node_days / n)
        for k, n in counts.items()
    ]
    return sorted(out, key=lambda c: (-c.failures, c.failure))


def observed_failure_rate(runs: list[Reliability]) -> tuple[float | None, int, float]:
    """Failures per node-day over ``runs`` (each job's restarts on its nodes over its wall clock):
    (rate, failures, node-days); the rate is None without a failure to go by."""
    failures = sum(len(r.attempts) - 1 for r in runs)
    node_days = _node_days(runs)
    return (failures / node_days if failures and node_days > 0 else None), failures, node_days


def _node_days(runs: list[Reliability]) -> float:
    """The node-days of ``runs``: each job's nodes times its wall clock."""
    return sum(r.nodes * r.wall_s for r in runs) / reliability.DAY_S
