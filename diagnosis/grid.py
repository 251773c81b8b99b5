"""The analyzed steps as rank x column arrays: the step grid the straggler, contention and job-wide
rules read, and the robust statistics they take of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pandas as pd

from .robust import dense_index


class Span(Protocol):
    """Which steps a grid holds (``StragglerSettings`` is one)."""

    @property
    def warmup_steps(self) -> int: ...
    @property
    def last_steps(self) -> int: ...
    @property
    def chunks(self) -> int: ...
    @property
    def min_s(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Cut:
    """A :class:`Span` for a rule with no settings of its own for it."""

    warmup_steps: int
    last_steps: int
    chunks: int
    min_s: float = 0.0


def nanmedian(a: np.ndarray, axis: int) -> np.ndarray:
    """Median along ``axis`` ignoring NaN, vectorized (numpy's loops over rows in Python)."""
    if not np.isnan(a).any():
        return np.median(a, axis=axis)  # a partition, cheaper than the sort below
    s = np.sort(a, axis=axis)  # NaN sort last
    n = np.sum(~np.isnan(a), axis=axis, keepdims=True)
    lo = np.take_along_axis(s, np.maximum((n - 1) // 2, 0), axis=axis)
    hi = np.take_along_axis(s, np.maximum(n // 2, 0), axis=axis)
    out = np.where(n > 0, (lo + hi) / 2, np.nan)
    return np.squeeze(out, axis=axis)


WIDTH = "width"
"""A step frame's column in which a large job's reader says how many steps each row stands for
(``diagnosis.data.read_job``): each row is then a bucket of that many consecutive steps from its
``step`` on (a multiple of it), with the mean values per step. Without it, a row is one step."""


def width(steps: pd.DataFrame) -> int:
    """How many steps each row of ``steps`` stands for (see ``WIDTH``)."""
    return int(steps[WIDTH].iloc[0]) if WIDTH in steps.columns and not steps.empty else 1


@dataclass(frozen=True, slots=True)
class Grid:
    """The analyzed steps as rank x column arrays (NaN where a rank has no row for a column); a
    column is one step, or ``width`` consecutive steps of a large job (see ``WIDTH``)."""

    ranks: np.ndarray
    chunk: np.ndarray
    """The chunk number of each column."""
    values: dict[str, np.ndarray]
    first_step: int = 0
    """The step of the first column."""
    width: int = 1
    """Steps per column."""

    @property
    def steps(self) -> int:
        return self.chunk.size * self.width

    def chunk_steps(self, chunks: int) -> np.ndarray:
        """The steps in each chunk."""
        return np.bincount(self.chunk, minlength=chunks) * self.width

    def chunk_starts(self, chunks: int) -> np.ndarray:
        """The first step of each chunk."""
        return self.first_step + np.concatenate([[0], np.cumsum(self.chunk_steps(chunks))[:-1]])


OWN_PARTS = ("dur_us", "comm_us", "wait_us")
"""A rank's own time per step is its step time less its time in collectives (waiting for peers)
and its main thread's run-queue wait (waiting for a CPU: on shared cores the order in which the
ranks leave a collective decides who queues, and by it alone healthy ranks can differ by 1.25x
in own time at the same CPU time; less the wait, by ~1.01x). A rank starved of CPU is the
contention finding's, from all its threads' wait. Rows without a wait (older hooks, other kernels)
count none."""


COLUMNS = ("own_us", "data_us", "comm_us", "cpu_us", "nivcsw", "gc_us")
"""What a straggler is described by, per step (``gc_us`` where the hook timed collections)."""


def columns(steps: pd.DataFrame) -> list[str]:
    """``COLUMNS`` that ``steps`` has (``own_us`` is derived)."""
    return [c for c in COLUMNS if c == "own_us" or c in steps]


def grid(steps: pd.DataFrame, s: Span, columns: list[str]) -> Grid | None:
    """The analyzed steps of ``columns`` (``own_us`` derived, see ``OWN_PARTS``): the most recent
    ``last_steps`` after ``warmup_steps``, split into ``chunks`` consecutive chunks."""
    if steps.empty:
        return None
    w = width(steps)
    step = steps["step"].to_numpy(dtype=np.int64)
    lo = int(step.min()) + s.warmup_steps
    hi = int(step.max())
    lo = max(lo, hi + w - s.last_steps)  # the last ``last_steps`` (whole columns: from one's start)
    lo = -(-lo // w) * w
    within = (step >= lo) & (step <= hi)
    if not within.any():
        return None
    sel: slice | np.ndarray = slice(None) if within.all() else within  # every row: no copies
    ranks, ri = dense_index(steps["rank"].to_numpy(dtype=np.int64)[sel])
    si = (step[sel] - lo) // w
    span = (hi - lo) // w + 1
    cell = ri * span + si
    # The store returns rows ordered by rank and step: then the grid is the column, reshaped.
    dense = len(cell) == len(ranks) * span and bool(np.all(cell == np.arange(len(cell))))
    values = {}
    own_parts = [c for c in OWN_PARTS if c in steps.columns]
    need = set(columns) - {"own_us"} | (set(own_parts) if "own_us" in columns else set())
    for c in sorted(need):
        x = steps[c].to_numpy(dtype=np.float64)[sel]
        if dense:
            values[c] = x.reshape(len(ranks), span)
            continue
        g = np.full(len(ranks) * span, np.nan)
        g[cell] = x
        values[c] = g.reshape(len(ranks), span)
    if "own_us" in columns:
        wait = values["wait_us"] if "wait_us" in own_parts else 0.0
        values["own_us"] = np.clip(values["dur_us"] - values["comm_us"] - wait, 0, None)
    chunk = np.minimum(np.arange(span) * s.chunks // max(span, 1), s.chunks - 1)
    return Grid(ranks=ranks, chunk=chunk, values=values, first_step=lo, width=w)


def young(steps: pd.DataFrame, g: Grid, s: Span) -> bool:
    """Whether the analyzed steps are a young job's: fewer than ``last_steps`` of them, from the
    first one's start to the last one's end fewer than ``min_s`` seconds. Steps without their
    start times (``start_us``: a store's read has them) are of a job of unknown age: not young."""
    if g.steps >= s.last_steps or "start_us" not in steps:
        return False
    mine = steps[steps["step"] >= g.first_step]
    return int((mine["start_us"] + mine["dur_us"]).max() - mine["start_us"].min()) < s.min_s * 1e6


def nanmean_rows(a: np.ndarray) -> np.ndarray:
    """Mean of each row ignoring NaN (NaN for a row without values), without numpy's warning."""
    ok = ~np.isnan(a)
    n = ok.sum(axis=1)
    return np.where(n > 0, np.where(ok, a, 0.0).sum(axis=1) / np.maximum(n, 1), np.nan)


def chunk_means(g: Grid, column: str, chunks: int) -> np.ndarray:
    """rank x chunk means of ``column`` (NaN where a rank has no step in a chunk): one pass over
    the grid, as a chunk's steps are consecutive columns."""
    v = g.values[column]
    out = np.full((v.shape[0], chunks), np.nan)
    present = np.unique(g.chunk)
    if present.size == 0:
        return out
    at = np.searchsorted(g.chunk, present)  # where each chunk's columns start
    ok = ~np.isnan(v)
    if ok.all():
        out[:, present] = np.add.reduceat(v, at, axis=1) / np.diff(np.append(at, g.chunk.size))
        return out
    sums, n = (
        np.add.reduceat(np.where(ok, v, 0.0), at, axis=1),
        np.add.reduceat(ok, at, axis=1, dtype=np.int64),
    )
    with np.errstate(invalid="ignore"):
        out[:, present] = np.where(n > 0, sums / np.maximum(n, 1), np.nan)
    return out


def chunk_medians(g: Grid, column: str, chunks: int) -> np.ndarray:
    """rank x chunk medians of ``column`` (NaN where a rank has no step in a chunk)."""
    v = g.values[column]
    return np.stack([nanmedian(v[:, g.chunk == c], axis=1) for c in range(chunks)], axis=1)
