"""The diagnosis input: one job's stored records as data frames (one column per field).

:func:`read_job` fills them from a store; tests and the simulator build them directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import pandas as pd

from rankscope.wire import records
from rankscope.wire.records import TRANSFER_PREFIX, WAIT_KIND, WAIT_PATTERN

STEP_FIELDS = [
    "rank",
    "step",
    "dur_us",
    "data_us",
    "comm_us",
    "cpu_us",
    "nivcsw",
    "wait_us",
    "gc_us",
]
"""The columns of :attr:`JobData.steps` (a store's read adds ``start_us``): what the detectors use of
a step, not the collectives' count and first entry the hook ships too."""
FUNCTION_FIELDS = [
    "rank",
    "window",
    "step_lo",
    "step_hi",
    "kind",
    "name",
    "stack",
    "count",
    "total_us",
    "mean_us",
]
HEARTBEAT_FIELDS = [
    "rank",
    "time_us",
    "step",
    "progress_age_s",
    "coll_group",
    "coll_op",
    "coll_seq",
    "coll_peer",
    "last_seq",
    "stack",
    "window_cost_us",
    "gpu_xids",
]


LINK_FIELDS = ["rank", "time_us", "link", "nbytes", "send_us"]
EXIT_FIELDS = [
    "rank",
    "host",
    "pid",
    "attempt",
    "how",
    "step",
    "error",
    "message",
    "frame",
    "signal",
    "gpu",
    "time_us",
]

SPAN_COLUMNS = ["rank", "window", "step_lo", "step_hi"]
"""What the diagnosis reads of a profiling window: the steps it spans."""

LOOKBACK_STEPS = 5000
"""The steps :func:`read_job` reads by default, back from the last: more than any detector looks
back over at its default settings (the change-point rule 4,000 after a warm-up of 10, the job-wide
rule 3,000). A job's whole history would grow without end: at 1,000 ranks of 100 ms steps, a day
holds 864 million steps."""

MAX_STEP_CELLS = 8_000_000
"""Rank-steps :func:`read_job` reads one by one at most (~1 GB of step rows, and as much again in
the detectors' rank x step arrays); of a larger job it reads buckets of steps, each summed up by
the store (``Reads.steps`` ``width``): the fewest steps a bucket (a power of two) that keep the
buckets under ``MAX_BUCKETS``, and no fewer than a stored row holds. The hooks ship a rank's steps
in blocks of ~2 s (``profiler_hook.Config.step_block_s``; 20 steps of 100 ms): a bucket narrower
than a block holds no more of them, and leaves buckets empty between the blocks' starts (at 10,000
ranks in buckets of 8, 3 of every 5 were: grids of 6.25 million cells, 60% of them NaN)."""

MAX_BUCKETS = 4_000_000
"""Buckets of steps :func:`read_job` reads at most (see ``MAX_STEP_CELLS``): each one ClickHouse
sums up, hands over and the detectors place in their grids. At 10,000 ranks of 100 ms steps, 5,000
steps are read in buckets of 32 (a block's 20 steps, to the next power of two); at 100,000, of 128:
the peer rule's last 800 steps are then 6 buckets, one a chunk, and its finer look for bursts
(24 spans) sees no more than those 6."""

FLEET = ((WAIT_KIND, WAIT_PATTERN), ("collective", TRANSFER_PREFIX))
"""The function patterns (kind, name prefix) every rank is compared on: its threads' run-queue wait
and its network sends, a row or two of a window's ~300. Of the others, the diagnosis needs those of
a culprit and a few peers: a store's :func:`read_job` reads them when asked (:meth:`JobData.functions_of`)."""

FLEET_COLUMNS = [*FUNCTION_FIELDS, "p50_us", "nbytes"]
"""What the diagnosis reads of the ``FLEET`` rows (a row per rank and window: at 100,000 ranks over
10 minutes, 2 million): ``functions``' columns and what the transfer rule needs besides, not the
summary's eight others."""


def _empty(columns: list[str]) -> pd.DataFrame:
    return pd.DataFrame({c: [] for c in columns})


@dataclass(frozen=True, slots=True, kw_only=True)
class JobData:
    job: str
    ranks: pd.DataFrame = field(default_factory=lambda: _empty(["rank", "host", "nic", "switch", "spine"]))
    """One row per rank: rank, host, nic, switch, spine."""
    steps: pd.DataFrame = field(default_factory=lambda: _empty(STEP_FIELDS))
    """One row per rank and step (``StepRow`` columns)."""
    functions: pd.DataFrame = field(default_factory=lambda: _empty(FUNCTION_FIELDS))
    """One row per rank, window and function (``FunctionPattern`` columns): all of them, or where
    ``read_functions`` is set (data read from a store) those of the ``FLEET`` patterns only."""
    read_functions: Callable[[list[int]], pd.DataFrame] | None = None
    """Reads every function row of the given ranks over the span of the other rows (None: all are
    in ``functions``). At 1,000 ranks, 10 minutes of windows hold 6 million rows; the diagnosis
    reads those of the culprits and a few peers."""
    windows: pd.DataFrame = field(default_factory=lambda: _empty(SPAN_COLUMNS))
    """One row per rank and profiling window (empty: those of ``functions``, see :meth:`spans`)."""
    heartbeats: pd.DataFrame = field(default_factory=lambda: _empty(HEARTBEAT_FIELDS))
    """The latest heartbeat of each rank."""
    samples: pd.DataFrame = field(default_factory=lambda: _empty(["rank", "function", "samples"]))
    """Per rank and function of the job's own code, the heartbeats' stack samples of the span read."""
    read_samples: Callable[[int], pd.DataFrame] | None = None
    """Reads ``samples`` of the heartbeats since a time (µs) within the span (None: only the
    span's are known)."""
    links: pd.DataFrame = field(default_factory=lambda: _empty(LINK_FIELDS))
    """Per heartbeat of the span read and network link of its rank, the sends since the rank's last."""
    exits: pd.DataFrame = field(default_factory=lambda: _empty(EXIT_FIELDS))
    """One row per process that said how it ended (``wire.records.Exit``), by time."""
    missing: pd.DataFrame = field(default_factory=lambda: _empty(["rank", "pid", "made", "stored"]))
    """Per rank and process whose records did not all reach the store: the records it numbered
    (up to its last one stored) and those stored."""

    def functions_of(self, ranks: Iterable[int]) -> pd.DataFrame:
        """Every function row of ``ranks``."""
        wanted = sorted({int(r) for r in ranks})
        if self.read_functions is not None:
            return self.read_functions(wanted) if wanted else _empty(FUNCTION_FIELDS)
        f = self.functions
        return f if f.empty else f[f["rank"].isin(wanted)]

    def samples_since(self, since_us: int) -> pd.DataFrame:
        """The stack samples of the heartbeats since ``since_us``, where the store can tell; else
        those of the span read."""
        return self.samples if self.read_samples is None else self.read_samples(since_us)

    def spans(self) -> pd.DataFrame:
        """One row per rank and profiling window: ``rank, window, step_lo, step_hi``."""
        if not self.windows.empty or self.read_functions is not None:
            return self.windows
        f = self.functions
        if f.empty:
            return _empty(SPAN_COLUMNS)
        cols = [c for c in SPAN_COLUMNS if c in f]
        return f[cols].drop_duplicates(["rank", "window"]).reset_index(drop=True)

    def attempt_steps(self) -> pd.DataFrame:
        """The steps of the ranks' latest start: of a job that restarted, those its processes ran
        now, not the attempt before (other processes, maybe on other hosts). Where the ranks'
        starts are not known (steps without ``start_us``), every step."""
        steps = self.steps
        if steps.empty or "start_us" not in steps or "time_us" not in self.ranks or self.ranks.empty:
            return steps
        start = int(self.ranks["time_us"].min())
        first = steps["start_us"] >= start
        return steps if first.all() else steps[first]

    def roles(self) -> list[list[int]]:
        """The job's ranks grouped by role: the same coordinates on the pipeline dimensions of its
        device mesh (``wire.records.pipeline_role``); one group where it has none. A pipeline's stages do
        different work by design (the first embeds, the last computes the loss), so a rank is
        compared only with the ranks of its stage, its data-parallel replicas; tensor, context and
        expert parallel ranks share their work evenly, and are compared with each other."""
        ranks = self.ranks
        # Most jobs have no mesh: their ranks' records carry empty ones (one pass over them, not a
        # role per rank: 0.12 s a diagnosis at 100,000 ranks).
        if "mesh" not in ranks or ranks.empty or not any(ranks["mesh"]):
            return [sorted(int(r) for r in (ranks if not ranks.empty else self.steps)["rank"].unique())]
        by_role: dict[tuple[tuple[str, int], ...], list[int]] = {}
        for rank, mesh in zip(ranks["rank"].astype(int), ranks["mesh"], strict=True):
            by_role.setdefault(records.pipeline_role(dict(mesh or {})), []).append(rank)
        return [sorted(g) for _, g in sorted(by_role.items())]

    def of_ranks(self, ranks: Iterable[int]) -> JobData:
        """This job's data of ``ranks`` only (a role's, to be compared among themselves)."""
        wanted = sorted({int(r) for r in ranks})

        def cut(df: pd.DataFrame) -> pd.DataFrame:
            return df[df["rank"].isin(wanted)] if "rank" in df and not df.empty else df

        read_samples = self.read_samples
        return replace(
            self,
            ranks=cut(self.ranks),
            steps=cut(self.steps),
            functions=cut(self.functions),
            windows=cut(self.windows),
            heartbeats=cut(self.heartbeats),
            samples=cut(self.samples),
            read_samples=(lambda since_us: cut(read_samples(since_us))) if read_samples is not None else None,
            links=cut(self.links),
            exits=cut(self.exits),
            missing=cut(self.missing),
        )

    def hosts(self) -> dict[int, str]:
        return dict(zip(self.ranks["rank"].astype(int), self.ranks["host"].astype(str), strict=False))

    def hosts_of(self, ranks: Iterable[int]) -> dict[int, str]:
        """The hosts of ``ranks`` only: a dict of every rank costs 0.1 s at 100,000 ranks."""
        wanted = list(ranks)
        if not wanted or "rank" not in self.ranks:
            return {}
        mine = self.ranks[self.ranks["rank"].isin(wanted)]
        return dict(zip(mine["rank"].astype(int), mine["host"].astype(str), strict=False))


class StoreReader(Protocol):
    """What :func:`read_job` and :class:`RecentJob` need of a store (``aggregator.Store`` has it;
    the diagnosis does not import the aggregator: data flows from it, not back)."""

    def ranks(self, job: str) -> pd.DataFrame: ...
    def last_step(self, job: str) -> int | None: ...
    def steps_per_row(self, job: str) -> float: ...
    def steps(
        self,
        job: str,
        since_step: int | None = None,
        since_us: int | None = None,
        rank: int | None = None,
        after_us: Sequence[int] | None = None,
        width: int = 1,
        columns: Sequence[str] | None = None,
    ) -> pd.DataFrame: ...
    def functions(
        self,
        job: str,
        windows: list[int] | None = None,
        since_us: int | None = None,
        from_window: Sequence[int] | None = None,
        ranks: Sequence[int] | None = None,
        patterns: Sequence[tuple[str, str]] | None = None,
        columns: Sequence[str] | None = None,
    ) -> pd.DataFrame: ...
    def windows(
        self, job: str, since_us: int | None = None, columns: Sequence[str] | None = None
    ) -> pd.DataFrame: ...
    def heartbeats_latest(self, job: str, columns: Sequence[str] | None = None) -> pd.DataFrame: ...
    def stack_samples(self, job: str, since_us: int | None = None) -> pd.DataFrame: ...
    def link_sends(self, job: str, since_us: int | None = None) -> pd.DataFrame: ...
    def missing(self, job: str) -> pd.DataFrame: ...
    def exits(self, job: str) -> pd.DataFrame: ...


def read_job(
    store: StoreReader, job: str, since_us: int | None = None, last_steps: int | None = LOOKBACK_STEPS
) -> JobData:
    """Everything the diagnosis reads about ``job`` in ``store``.

    With ``since_us``, only the steps and the windows from then on (the ranks and each rank's
    latest heartbeat whenever they came): what a running job's diagnosis needs, in time that does
    not grow with the job's age. Of a longer job, its last ``last_steps`` steps (None: all of
    them), and the windows and heartbeats since the first of them. Of the function rows, those of
    ``FLEET``; the others are read when the diagnosis asks for them, from ``store``, which must
    then still be open.
    """
    last = store.last_step(job)
    ranks = store.ranks(job)
    w = _bucket(ranks, last, last_steps, lambda: store.steps_per_row(job))
    if last is not None and last_steps is not None and last >= last_steps:
        steps = store.steps(
            job, since_step=last - last_steps + 1, since_us=since_us, width=w, columns=STEP_FIELDS
        )
        if not steps.empty:
            since_us = max(since_us or 0, int(steps["start_us"].min()))
    else:
        steps = store.steps(job, since_us=since_us, width=w, columns=STEP_FIELDS)
    return JobData(
        job=job,
        ranks=ranks,
        steps=steps,
        functions=store.functions(job, since_us=since_us, patterns=FLEET, columns=FLEET_COLUMNS),
        read_functions=lambda ranks: store.functions(job, since_us=since_us, ranks=ranks),
        windows=store.windows(job, since_us=since_us, columns=SPAN_COLUMNS),
        heartbeats=store.heartbeats_latest(job, columns=HEARTBEAT_FIELDS),
        samples=store.stack_samples(job, since_us=since_us),
        read_samples=lambda t: store.stack_samples(job, since_us=max(t, since_us or 0)),
        links=store.link_sends(job, since_us=since_us),
        missing=store.missing(job),
        exits=store.exits(job),
    )


def _bucket(ranks: pd.DataFrame, last: int | None, last_steps: int | None, block: Callable[[], float]) -> int:
    """The steps per row to read of a job of ``ranks`` up to its step ``last``, back ``last_steps``
    steps (None: all), its stored rows holding ``block()`` steps each (asked only of a job read in
    buckets; see ``MAX_STEP_CELLS``)."""
    n = ranks["rank"].nunique() if "rank" in ranks else 0
    steps = min(last + 1, last_steps or last + 1) if last is not None else 0
    if n * steps <= MAX_STEP_CELLS:
        return 1
    w = 1 << max(0, math.ceil(math.log2(max(block(), 1.0))))
    while n * -(-steps // w) > MAX_BUCKETS:
        w *= 2
    return w


class RecentJob:
    """A running job's last ``recent_s`` seconds of steps and windows (their ``FLEET`` patterns), kept
    in memory and brought up to date from what the store gained since (what ``rankscope serve``
    diagnoses every cycle).

    An update reads each rank's step rows that start after the last step it holds and the windows
    after the last one it holds: seconds of rows, where :func:`read_job` would read all of the last
    ``recent_s`` again (at 1,000 ranks of 100 ms steps, 6 million steps). It reads everything
    afresh when the ranks' records change (a rank started or restarted: a restarted rank redoes
    steps it had shipped, and numbers windows anew) and when new rows would overlap held steps.
    Rows come out in the order they arrived, not sorted: the diagnosis does not need them sorted.

    A job too large to hold step by step (``MAX_STEP_CELLS``, as :func:`read_job` decides) is held
    in buckets of steps: an update reads each rank's last bucket held again, now with the rows it
    gained, and the buckets after it; a wider bucket (the job grew) is read afresh.
    """

    def __init__(self, job: str, recent_s: float) -> None:
        self.job, self.recent_s = job, recent_s
        self.data: JobData | None = None
        self._start_us = np.zeros(0, dtype=np.int64)
        """Per rank (by index), the start of the last step held (0: none)."""
        self._last_step = np.full(0, -1, dtype=np.int64)
        self._next_window = np.zeros(0, dtype=np.int64)
        """Per rank, the first window number not held yet."""
        self._trimmed_us = 0
        """The ``since`` of the last time rows too old were dropped."""
        self._width = 1
        """The steps a row held stands for."""

    def update(self, store: StoreReader, last_us: int, recent_s: float | None = None) -> JobData:
        """The job's data for its last ``recent_s`` seconds (by default, as before) up to
        ``last_us`` (its latest record)."""
        if recent_s is not None and recent_s != self.recent_s:
            self.recent_s, self.data = recent_s, None  # another span: read afresh
        since = last_us - int(self.recent_s * 1e6)
        ranks, beats = store.ranks(self.job), store.heartbeats_latest(self.job, columns=HEARTBEAT_FIELDS)
        # A row per rank and function, and per heartbeat and link: read whole.
        samples, links, windows, missing, exits = (
            store.stack_samples(self.job, since_us=since),
            store.link_sends(self.job, since_us=since),
            store.windows(self.job, since_us=since, columns=SPAN_COLUMNS),
            store.missing(self.job),  # over the job's life: one row per process
            store.exits(self.job),  # as much
        )

        def held(steps: pd.DataFrame, fns: pd.DataFrame) -> JobData:
            return JobData(
                job=self.job,
                ranks=ranks,
                steps=steps,
                functions=fns,
                read_functions=lambda ranks: store.functions(self.job, since_us=since, ranks=ranks),
                windows=windows,
                heartbeats=beats,
                samples=samples,
                read_samples=lambda t: store.stack_samples(self.job, since_us=max(t, since)),
                links=links,
                exits=exits,
                missing=missing,
            )

        w = _bucket(ranks, store.last_step(self.job), LOOKBACK_STEPS, lambda: store.steps_per_row(self.job))
        old = self.data
        if old is not None and w == self._width and ranks.equals(old.ranks):
            if w > 1:
                # Each rank's last bucket again (its rows start at or after the bucket's first),
                # in place of the one held: it may have gained rows since.
                new_steps = store.steps(
                    self.job, after_us=(self._start_us - 1).tolist(), width=w, columns=STEP_FIELDS
                )
                kept = old.steps
                if not kept.empty:
                    again = self._last_held(kept, np.iinfo(np.int64).max)
                    kept = _keep(kept, kept["step"].to_numpy(dtype=np.int64) < again)
            else:
                new_steps, kept = (
                    store.steps(self.job, after_us=self._start_us.tolist(), columns=STEP_FIELDS),
                    old.steps,
                )
            new_fns = store.functions(
                self.job, from_window=self._next_window.tolist(), patterns=FLEET, columns=FLEET_COLUMNS
            )
            if w > 1 or not self._overlaps(new_steps):
                steps, fns = _concat(kept, new_steps), _concat(old.functions, new_fns)
                if since - self._trimmed_us >= self.recent_s * 1e5 and not steps.empty:
                    # Every tenth of ``recent_s`` (a copy of every row costs more than the rows
                    # held a little longer): the steps that ended before ``since`` go, and the
                    # windows over none of the steps left.
                    end = steps["start_us"].to_numpy() + steps["dur_us"].to_numpy() * w
                    steps = _keep(steps, end > since)
                    if not fns.empty and not steps.empty:
                        fns = _keep(fns, fns["step_hi"].to_numpy() >= int(steps["step"].min()))
                    self._trimmed_us = since
                self.data = held(steps, fns)
                self._mark(new_steps, new_fns)
                return self.data
        steps, fns = (
            store.steps(self.job, since_us=since, width=w, columns=STEP_FIELDS),
            store.functions(self.job, since_us=since, patterns=FLEET, columns=FLEET_COLUMNS),
        )
        self.data, self._width = held(steps, fns), w
        self._start_us, self._last_step = np.zeros(0, dtype=np.int64), np.full(0, -1, dtype=np.int64)
        self._next_window = np.zeros(0, dtype=np.int64)
        self._trimmed_us = since
        self._mark(steps, fns)
        return self.data

    def _overlaps(self, steps: pd.DataFrame) -> bool:
        """Whether ``steps`` holds a step at or before the last one held of its rank."""
        if steps.empty:
            return False
        return bool((steps["step"].to_numpy(dtype=np.int64) <= self._last_held(steps, -1)).any())

    def _last_held(self, steps: pd.DataFrame, none: int) -> np.ndarray:
        """Per row of ``steps``, the last step (or bucket) held of its rank (``none`` where none)."""
        rank = steps["rank"].to_numpy(dtype=np.int64)
        held, known = np.full(len(rank), none, dtype=np.int64), rank < len(self._last_step)
        held[known] = self._last_step[rank[known]]
        return held

    def _mark(self, steps: pd.DataFrame, fns: pd.DataFrame) -> None:
        if not steps.empty:
            rank = steps["rank"].to_numpy(dtype=np.int64)
            # The start of the last step held: at or after its row's start, before the next row's.
            start = steps["start_us"].to_numpy(dtype=np.int64)
            self._start_us = _grow(self._start_us, rank, start, 0)
            self._last_step = _grow(self._last_step, rank, steps["step"].to_numpy(dtype=np.int64), -1)
        if not fns.empty:
            rank = fns["rank"].to_numpy(dtype=np.int64)
            self._next_window = _grow(self._next_window, rank, fns["window"].to_numpy(dtype=np.int64) + 1, 0)


def _grow(marks: np.ndarray, rank: np.ndarray, value: np.ndarray, empty: int) -> np.ndarray:
    """``marks`` (per rank by index, ``empty`` where none) raised to the largest ``value`` per ``rank``."""
    out = np.full(max(len(marks), int(rank.max()) + 1), empty, dtype=np.int64)
    out[: len(marks)] = marks
    np.maximum.at(out, rank, value)
    return out


def _concat(old: pd.DataFrame, new: pd.DataFrame) -> pd.DataFrame:
    return old if new.empty else new if old.empty else pd.concat([old, new], ignore_index=True)


def _keep(frame: pd.DataFrame, keep: np.ndarray) -> pd.DataFrame:
    """The rows of ``frame`` where ``keep``: ``frame`` itself, not a copy, when that is every row."""
    return frame if keep.all() else frame[keep].reset_index(drop=True)
