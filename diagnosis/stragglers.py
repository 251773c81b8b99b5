"""Which ranks hold the job back, from the always-on step rows.

The wait inversion: in synchronous training every rank leaves each collective at the same time, so
a slow rank's peers show LONG collectives (they wait for it) and the culprit the shortest. Raw
step or collective time therefore points at the wrong ranks. What a rank spends *outside* the
collectives — its own time, ``dur - comm`` — is what separates the culprit: it is the largest on
the rank everybody waits for.

Per chunk of consecutive steps, each rank's mean own time relative to the other ranks' on the
same steps is compared across ranks with a robust z-score (median / MAD). A rank that stands out in
most chunks is a straggler; the part of its own time that exceeds its peers (data wait, or compute)
gives the first cause. Means, not medians, over the steps of a chunk: the job loses the sum of the
extra time, and a rank slow on every 20th step or in bursts holds the job back as much as its mean
says, while its median step looks healthy. Across ranks the statistics stay robust (medians).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from .findings import effect
from .robust import dense_index, evenly, needed


@dataclass(frozen=True, slots=True, kw_only=True)
class StragglerSettings:
    warmup_steps: int = 10
    """Steps skipped at the start of the analyzed range (first-iteration allocation, JIT)."""
    last_steps: int = 800
    """Only the most recent this-many steps are analyzed: the answer describes the job now. A
    straggler must be slow in half the chunks, so it is found once its fault covers half of this
    range (or of the job's steps, if fewer): the shorter the range, the sooner a fault is found.
    800 steps are enough to name faults right and to find no straggler on a healthy job."""
    chunks: int = 6
    """The analyzed steps are split into this many consecutive chunks."""
    min_chunk_steps: int = 5
    """Fewer steps than this per chunk (30 in all) is too few to tell a straggler from noise: over a
    second of steps or less, a healthy rank can read 1.49x its peers."""
    min_s: float = 10.0
    """...and until the analyzed range holds ``last_steps``, fewer seconds of steps than this is a
    job too young to compare its ranks: in its first seconds a healthy rank's own time can read
    1.15x its peers' for 1-5 s (imports still running on background threads, allocator and cache
    warm-up, the first profiling window). A fault from the first step is found this much later;
    a ticket waits 15 s anyway (``api.tickets.Rules.open_after_s``)."""
    min_ratio: float = 1.10
    """A rank's mean own time (per step, relative to the step's median) must exceed the ranks' median
    by this factor to count as slow in a chunk."""
    min_z: float = 3.5
    """...and by this many robust standard deviations."""
    z_min_ranks: int = 8
    """The z-score test applies from this many ranks on; below, a MAD is too unstable to use."""
    mad_floor: float = 0.03
    """The robust deviation is never taken below this fraction of the median (quiet jobs)."""
    persistence: float = 0.5
    """A straggler must be slow in at least this fraction of the chunks."""
    cpu_min_ratio: float = 1.15
    """The peer rule on the main thread's CPU time per step as well: a rank whose CPU time exceeds
    the ranks' median by this factor in as many chunks (healthy ranks stay within ~1.06x: the
    run-queue waits that spread own time are not in it), and whose own time is above its
    peers' by ``shift_min_level``, is a straggler. A device slower in bursts shows in a chunk's CPU
    time more plainly than in its own time."""
    burst_chunks: int = 24
    """Bursts: the analyzed steps are split this finer too (of ``burst_min_chunk_steps`` steps at
    least), for a rank slow in bursts too short or too rare to be slow in half of the chunks: over
    the whole range such a rank's CPU time is barely above its peers' (~1.06x), in the fine chunks
    of a burst plainly so (1.13-1.23x)."""
    burst_min_chunk_steps: int = 20
    burst_cpu_ratio: float = 1.10
    """A rank is slow in a fine chunk when its CPU time per step is this many times the chunk's
    median over the ranks..."""
    burst_own_ratio: float = 1.05
    """...and its own time this many times..."""
    burst_min_chunks: int = 6
    """...in this many fine chunks at least: a rank that is no culprit is slow so in 3 of 24 at most
    (around hangs; on a healthy job in 1 at most), an intermittent straggler in 7 or more."""
    burst_steady: float = 0.75
    """A rank slow in this share of the fine chunks or more, that the chunk rule finds too, is
    steady: the chunk rule's account describes it (a steady straggler is slow in 22-24 of 24; a
    device 2x slower 100 steps in 300, slow in 12 of 24 and in 3 of 6 chunks, is in bursts)."""
    peel_ratio: float = 1.15
    """Once stragglers are found, another rank is one too if its mean own time exceeds the median
    of the remaining ranks by this factor (stricter than ``min_ratio``: healthy ranks of a small
    job on shared cores differ by up to ~1.09x)."""
    shift_steps: int = 4000
    """The change-point rule (:func:`shifted`) looks back this many steps..."""
    shift_chunks: int = 20
    """...split into this many chunks (of ``min_chunk_steps`` * 4 steps at least)."""
    shift_min_t: float = 5.0
    """A rank's rise must be this many standard errors (its own chunk-to-chunk noise). On shared
    cores, with own time less the run-queue wait, a rank without a fault reaches a t of up to ~5.6
    with a rise under 0.05, a 1.15x slower device 5.4-6.0 with a rise over 0.05. A thin margin:
    the rule catches clear shifts, and a mild one only as long as the rise gate holds."""
    shift_min_rise: float = 0.05
    """...and raise its own time, relative to its peers', by this much (healthy ranks: <= 0.09
    with a t of 3.5 at most)..."""
    shift_min_level: float = 1.04
    """...to at least this multiple of the peers' (a rank below them does not hold the job back)..."""
    shift_min_after: int = 6
    """...for this many chunks at least (and three before): on shared cores a healthy rank's own
    time can rise 1.02x -> 1.10x its peers' over its last 4 chunks."""
    shift_busy_share: float = 0.5
    """...and this share of the rise at least must show in its time outside the collectives with the
    run-queue wait left in: the hook reads the wait inside the collectives at some steps only, and
    where the rest of a step's wait falls moves with the ranks' order on shared cores: a healthy
    rank's own time can rise 0.89x -> 1.10x its peers' (a t of 5.3) only because less of its wait
    falls outside the collectives, its time outside the collectives and its CPU time unchanged. A
    slower device adds work and so time outside the collectives."""
    shift_cpu_bound: float = 0.8
    """A rank whose main thread's CPU time is this share of its own time at least is CPU-bound:
    there, half the rise must also show in its CPU time and data wait. A CPU-bound healthy rank's
    own time (and its time outside the collectives with it) can rise 0.95x -> 1.085x its peers' (a
    t of 5.3) with its CPU time unchanged; a slower device's CPU time rises by about two thirds of
    its own-time rise. (On a GPU the CPU waits for the device off the CPU, or spins: then it is no
    CPU-bound rank, or its CPU time rises.)"""
    shift_cpu_min_t: float = 5.0
    """The same split over the main thread's CPU time per step (relative to the peers'), for a
    rank whose own time does not pass both tests above: free of the run-queue waits that make
    own time noisy on shared cores, it moves by ~1% from chunk to chunk. A healthy rank reaches a t
    of 4 at most, with a rise of 0.026 at most; faults that add work on the CPU (a slower device, a
    code path, GC, a gradient hook) reach 5.3-21 with rises of 0.08-2.6. A rank found this way must
    still meet the own-time level above (it must hold the job back), and half the own-time rise (a
    slower device already above its peers can rise by 0.04 in own time, 0.10 in CPU time); whether
    it still holds at the end is judged on the CPU time..."""
    shift_cpu_min_rise: float = 0.04
    """...and its CPU time, relative to its peers', must have risen by this much (healthy ranks:
    0.026 at most; a 1.15x slower device: ~0.05, at a t of ~9, where its own time rises as surely
    but can fall a hair short of ``shift_min_rise``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Straggler:
    rank: int
    chunks_flagged: int
    chunks: int
    ratio: float
    """Mean over steps of (own time / that step's median own time), relative to the peers'."""
    own_us: float
    """The rank's mean own time per step (step time minus time inside collectives); the other
    values are means per step too, the peers' the median over the peers."""
    peer_own_us: float
    data_us: float
    peer_data_us: float
    comm_us: float
    peer_comm_us: float
    cpu_us: float
    peer_cpu_us: float
    nivcsw: float
    peer_nivcsw: float
    gc_us: float = 0.0
    """Garbage collection's pauses per step (part of its own time)."""
    peer_gc_us: float = 0.0
    since_step: int = -1
    """The first step of the first chunk in which the rank was slow."""
    held_steps: int = 0
    """Steps in the chunks in which it was slow."""
    before_ratio: float = 0.0
    """Found by the change-point rule: ``ratio`` before ``since_step`` (0 for the peer rule)."""
    cpu_growth: float = 0.0
    """Found by the change-point rule on CPU time: how much that grew against the peers' (0 if not)."""
    bursts: int = 0
    """Found slow in bursts: the fine chunks the rule asks for (``burst_min_chunks``; 0: not so
    found). Its values are then those of the steps of the fine chunks it was slow in."""

    @property
    def growth(self) -> float:
        """How much its own time grew against its peers' (``ratio`` for the peer rule); found on
        CPU time, the more that either grew: the CPU time is the same work measured without the
        run-queue noise, but holds none of the rank's other waits: a slower device's growth shows
        more in the one or in the other from job to job. Grown from below its peers, only to where
        it now is above them: that is what the job waits for it (a healthy rank that moves from
        0.90x its peers, its place on the shared cores, to 1.045x grows 1.045x by this count, not
        1.16x)."""
        own = self.ratio / max(self.before_ratio, 1.0) if self.before_ratio > 0 else self.ratio
        return max(self.cpu_growth, own)

    @property
    def persistence(self) -> float:
        """How steadily it held: the share of chunks it was slow in; in bursts, of twice the fine
        chunks the rule asks for (slow a quarter of the time is as sure as bursts get)."""
        if self.bursts:
            return min(1.0, self.chunks_flagged / (2 * self.bursts))
        return self.chunks_flagged / max(self.chunks, 1)

    @property
    def strength(self) -> float:
        """How sure the account is: its effect size times its persistence (the surer one of two
        accounts of a rank describes it)."""
        return effect(self.growth) * self.persistence

    @property
    def excess_us(self) -> float:
        return self.own_us - self.peer_own_us


MAX_PEERS = 4096
"""Peers whose medians make the peer median (evenly spread): exact enough, and cheap at 100k ranks."""


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


def grid(steps: pd.DataFrame, s: StragglerSettings, columns: list[str]) -> Grid | None:
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


def young(steps: pd.DataFrame, g: Grid, s: StragglerSettings) -> bool:
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


def _step_median(values: np.ndarray, among: np.ndarray | None = None) -> np.ndarray:
    """Each step's (column's) median over the ranks ``among`` (a row mask; all ranks if None), of
    ``MAX_PEERS`` of them evenly spread where there are more: as exact, and 25x cheaper at 100,000."""
    rows = evenly(np.arange(values.shape[0]) if among is None else np.flatnonzero(among), MAX_PEERS)
    return nanmedian(values[rows] if rows.size < values.shape[0] else values, axis=0)


def _relative(
    values: np.ndarray, among: np.ndarray | None = None, rows: np.ndarray | None = None
) -> np.ndarray:
    """rank x step ``values`` (of the ranks at ``rows`` only, if given) over each step's median of
    the ranks ``among`` (a row mask; all ranks if None), so that what the whole job does on a step
    cancels."""
    return (values if rows is None else values[rows]) / np.clip(_step_median(values, among), 1.0, None)[
        None, :
    ]


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


def _flag(
    per: np.ndarray, s: StragglerSettings, min_ratio: float, exclude: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int]:
    """Per rank, in how many chunks (and which) its mean relative own time stands out against the
    median of the ranks not ``exclude``d; and how many chunks could be judged."""
    flagged = np.zeros(per.shape[0], dtype=np.int64)
    slow_in = np.zeros(per.shape, dtype=bool)
    n_chunks = 0
    for c in range(per.shape[1]):
        col = per[:, c]
        valid = ~np.isnan(col)
        base = col[valid & ~exclude]
        if valid.sum() < 3 or base.size < 3:
            continue
        n_chunks += 1
        med = float(np.median(base))
        mad = float(np.median(np.abs(base - med))) * 1.4826
        scale = max(mad, s.mad_floor * abs(med), 1e-9)
        with np.errstate(invalid="ignore"):
            slow = col >= min_ratio * med
            if base.size >= s.z_min_ranks:
                slow &= (col - med) / scale >= s.min_z
        flagged += slow
        slow_in[:, c] = slow
    return flagged, slow_in, n_chunks


def find(
    steps: pd.DataFrame, s: StragglerSettings | None = None, roles: dict[int, int] | None = None
) -> list[Straggler]:
    """Ranks whose own time per step persistently exceeds their peers'.

    Each step's own times are divided by that step's median over the ranks first: machine-wide
    noise (a busy neighbour, a slow step for everybody) cancels, and what is left is how much
    longer this rank worked than the others on the very same step. With ``roles`` (rank -> role,
    a pipeline stage: ``JobData.roles``), over the median of the ranks of its role: what a stage
    does by design cancels too, and the ranks of every stage are judged together (two replicas of
    a stage cannot outvote each other; eight ranks of four stages can). A straggler's peers, what
    it is measured against, are then the other ranks of its role.
    """
    s = s or StragglerSettings()
    cols = columns(steps)
    g = grid(steps, s, cols)
    if g is None or len(g.ranks) < 3:
        return []  # two ranks cannot outvote each other
    if g.steps < s.chunks * s.min_chunk_steps or young(steps, g, s):
        return []
    role = (
        np.array([roles.get(int(r), -1) for r in g.ranks])
        if roles
        else np.zeros(len(g.ranks), dtype=np.int64)
    )

    def relative(values: np.ndarray) -> np.ndarray:
        """Each rank's values over its role's median on each step."""
        if not roles:
            return _relative(values)
        out = np.empty_like(values)
        for k in np.unique(role):
            out[role == k] = _relative(values[role == k])
        return out

    g.values["rel"] = relative(g.values["own_us"])
    per = chunk_means(g, "rel", s.chunks)
    flagged, slow_in, n_chunks = _flag(per, s, s.min_ratio, np.zeros(len(g.ranks), dtype=bool))
    is_culprit = flagged >= needed(n_chunks, s.persistence)
    cpu = g.values["cpu_us"]
    if np.nanmax(cpu, initial=0.0) > 0:
        g.values["rel_cpu"] = relative(cpu)
        per_cpu = chunk_means(g, "rel_cpu", s.chunks)
        by_cpu, slow_cpu, _ = _flag(per_cpu, s, s.cpu_min_ratio, np.zeros(len(g.ranks), dtype=bool))
        own_level = nanmean_rows(per) / np.nanmedian(nanmean_rows(per))
        more = (by_cpu >= needed(n_chunks, s.persistence)) & (own_level >= s.shift_min_level) & ~is_culprit
        flagged, is_culprit = np.where(more, by_cpu, flagged), is_culprit | more
        slow_in[more] = slow_cpu[more]
    burst_slow, fine = _bursts(g, s)
    bursty = burst_slow.sum(axis=1) >= s.burst_min_chunks
    is_culprit = is_culprit | bursty
    if not is_culprit.any():
        return []
    if (~is_culprit).sum() >= 3:
        # Two faults at once in a small job: the first culprit lifts the median the second is
        # measured against. Measured against the other ranks alone, at a stricter ratio.
        again, slow_again, _ = _flag(per, s, s.peel_ratio, is_culprit)
        more = (again >= needed(n_chunks, s.persistence)) & ~is_culprit
        flagged, is_culprit = np.where(more, again, flagged), is_culprit | more
        slow_in[more] = slow_again[more]
    peer_idx = np.flatnonzero(~is_culprit)
    if peer_idx.size == 0:
        return []  # everybody is "slow": that is a job-wide question, not a straggler
    peer_idx = evenly(peer_idx, MAX_PEERS)
    cul_idx = np.flatnonzero(is_culprit)
    chunk_steps, chunk_start = g.chunk_steps(s.chunks), g.chunk_starts(s.chunks)
    names = ["rel", *cols]
    own_mean = {c: nanmean_rows(g.values[c][cul_idx]) for c in names}
    out = []
    for j, i in enumerate(cul_idx):
        same = peer_idx[role[peer_idx] == role[i]]
        peers = same if same.size else peer_idx
        pm = {c: float(np.nanmedian(nanmean_rows(g.values[c][peers]))) for c in names}
        found = []
        if flagged[i] >= needed(n_chunks, s.persistence):
            mine = {c: float(own_mean[c][j]) for c in names}
            how = {
                "chunks_flagged": int(flagged[i]),
                "chunks": n_chunks,
                "since_step": int(chunk_start[np.argmax(slow_in[i])]),
                "held_steps": int(chunk_steps[slow_in[i]].sum()),
            }
            found.append(
                _straggler(int(g.ranks[i]), mine, pm, ratio=mine["rel"] / max(pm["rel"], 1e-9), **how)
            )
        if bursty[i] and (not found or burst_slow[i].sum() < s.burst_steady * s.burst_chunks):
            # Slow in bursts (steadier is the chunk rule's):
            # its values while slow, against the peers' on the same steps.
            at = burst_slow[i][fine]
            mine = {c: float(np.nanmean(g.values[c][i, at])) for c in names}
            peer = {c: float(np.nanmedian(nanmean_rows(g.values[c][peers][:, at]))) for c in names}
            how = {
                "chunks_flagged": int(burst_slow[i].sum()),
                "chunks": s.burst_chunks,
                "since_step": g.first_step + int(np.argmax(at)) * g.width,
                "held_steps": int(at.sum()) * g.width,
                "bursts": s.burst_min_chunks,
            }
            found.append(
                _straggler(int(g.ranks[i]), mine, peer, ratio=mine["rel"] / max(peer["rel"], 1e-9), **how)
            )
        out.append(max(found, key=lambda st: st.strength))
    return out


def _bursts(g: Grid, s: StragglerSettings) -> tuple[np.ndarray, np.ndarray]:
    """rank x fine chunk: slow in CPU and own time against the chunk's median over the ranks (all
    False where the steps are too few); and each step's fine chunk."""
    n, k = g.chunk.size, s.burst_chunks
    fine = np.minimum(np.arange(n) * k // max(n, 1), k - 1)
    slow = np.zeros((len(g.ranks), k), dtype=bool)
    if "rel_cpu" not in g.values or g.steps < k * s.burst_min_chunk_steps:
        return slow, fine
    fg = Grid(ranks=g.ranks, chunk=fine, values=g.values, first_step=g.first_step, width=g.width)
    cpu, own = chunk_means(fg, "rel_cpu", k), chunk_means(fg, "rel", k)
    with np.errstate(invalid="ignore"):
        slow = (cpu >= s.burst_cpu_ratio * nanmedian(cpu, axis=0)) & (
            own >= s.burst_own_ratio * nanmedian(own, axis=0)
        )
    return slow, fine


def _straggler(rank: int, own: dict[str, float], peer: dict[str, float], **how: Any) -> Straggler:
    """A straggler from its mean values per step (``own``) and its peers' (``peer``), by column."""
    return Straggler(
        rank=rank,
        own_us=own["own_us"],
        peer_own_us=peer["own_us"],
        data_us=own["data_us"],
        peer_data_us=peer["data_us"],
        comm_us=own["comm_us"],
        peer_comm_us=peer["comm_us"],
        cpu_us=own["cpu_us"],
        peer_cpu_us=peer["cpu_us"],
        nivcsw=own["nivcsw"],
        peer_nivcsw=peer["nivcsw"],
        gc_us=own.get("gc_us", 0.0),
        peer_gc_us=peer.get("gc_us", 0.0),
        **how,
    )


def slow_windows(steps: pd.DataFrame, windows: pd.DataFrame, st: Straggler, peers: list[int]) -> list[int]:
    """The profiling windows (``windows``: rows with ``window``, ``step_lo``, ``step_hi``) over
    whose steps the straggler's own time exceeded its peers' median by half its excess at least."""
    spans = windows[["window", "step_lo", "step_hi"]].drop_duplicates("window")
    if spans.empty or steps.empty:
        return []
    parts = [c for c in OWN_PARTS if c in steps.columns]
    cut = steps[steps["rank"].isin([st.rank, *peers])]
    own = cut[parts[0]] - cut[parts[1:]].sum(axis=1)
    cut = pd.DataFrame(
        {"rank": cut["rank"].to_numpy(), "step": cut["step"].to_numpy(), "own": own.to_numpy()}
    )
    bar, w = 1 + (st.ratio - 1) / 2, width(steps)
    out = []
    for window, lo, hi in spans.itertuples(index=False):
        x = cut[(cut["step"] + w > lo) & (cut["step"] < hi)].groupby("rank")["own"].mean()  # overlapping
        if st.rank in x.index and len(x) > 1:
            peer = float(x.drop(st.rank).median())
            if peer > 0 and x[st.rank] >= bar * peer:
                out.append(int(window))
    return out


def shift_grid(steps: pd.DataFrame, s: StragglerSettings) -> Grid | None:
    """The steps :func:`shifted` analyzes, for several calls on the same steps."""
    return grid(steps, replace(s, last_steps=s.shift_steps, chunks=s.shift_chunks), columns(steps))


def shifted(
    steps: pd.DataFrame,
    s: StragglerSettings | None = None,
    exclude: Iterable[int] = (),
    cut: Grid | None = None,
    only: int | None = None,
) -> list[Straggler]:
    """Ranks whose own time rose against their peers' at some step and stayed up (a change point).

    The peer rule needs a straggler to stand out from the ranks' spread, ~1.10x on shared cores.
    But much of that spread is each rank's own steady offset (its core, its NUMA node, its share
    of the data pipeline): on a quiet job a rank's own time relative to its peers moves by ~2%
    from chunk to chunk. A device that turns 1.15x slower lifts its rank from 0.98x to 1.07x: lost
    among the peers, plain against its own past. So per rank, over the last ``shift_steps``, the
    split of its chunk series that maximizes the standardized rise (a two-sample t over chunk
    means, as in CUSUM change-point detection) is found; a rank whose rise is large, certain, and
    leaves it above its peers is a straggler since that split. ``exclude``: ranks already found;
    ``cut``: :func:`shift_grid` of ``steps``, if the caller has it; ``only``: of that rank alone
    (the others are its peers still).
    """
    s = s or StragglerSettings()
    c = s.shift_chunks
    g = shift_grid(steps, s) if cut is None else cut
    if g is None or len(g.ranks) < 2 or g.steps < c * s.min_chunk_steps * 4 or young(steps, g, s):
        return []
    own = g.values["own_us"]
    skip = np.isin(g.ranks, list(exclude))
    # Two ranks cannot outvote each other (the peer rule needs three), but each can be measured
    # against its own past relative to the other: in a synchronous job their own times differ by
    # just the other's extra wait, and a rank that turned slower since some step rose against the
    # other there (a constant difference, rank 0's logging, say, is no change).
    pair = len(g.ranks) == 2 and not skip.any()
    if (~skip).sum() < 3 and not pair:
        return []

    def against(values: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """rank x step ``values`` (of ``rows`` only, if given) over the peers' on each step: the
        other rank of a pair, else the median of the ranks not skipped."""
        if not pair:
            return _relative(values, ~skip, rows)
        at = np.arange(2) if rows is None else rows
        return values[at] / np.clip(values[1 - at], 1.0, None)

    # Relative to the other ranks' median: a straggler found already would lift it on every step.
    peer_own = np.clip(own[::-1] if pair else _step_median(own, ~skip)[None, :], 1.0, None)
    g.values["rel"] = own / peer_own
    rel = chunk_means(g, "rel", c)
    if np.isnan(rel).any():
        return []  # a rank missing from some chunk: joined late or restarted, no series to split
    # The series of the ranks judged (``only``, or all): each against its peers' median per step.
    rows = np.flatnonzero(~skip if only is None else (g.ranks == only) & ~skip)

    def chunked(column: str, values: np.ndarray) -> np.ndarray:
        g.values[column] = values
        return chunk_means(g, column, c)

    mine = rel[rows]
    best_t, best_k = _best_split(mine, s.shift_min_after)
    rise = _rise(mine, best_k)
    by_own = (best_t >= s.shift_min_t) & (rise >= s.shift_min_rise)
    busy = chunked("rel_busy", against(g.values["dur_us"] - g.values["comm_us"], rows))
    by_own &= _rise(busy, best_k) >= s.shift_busy_share * rise
    # Where a rank's own time is CPU work, a rise in it is more CPU work or a longer wait for data.
    cpu = g.values["cpu_us"]
    peer_own_of = peer_own[rows] if pair else peer_own
    work = chunked("rel_work", (cpu[rows] + g.values["data_us"][rows]) / peer_own_of)  # in peers' own time
    cpu_bound = np.nanmean(cpu[rows], axis=1) >= s.shift_cpu_bound * np.nanmean(own[rows], axis=1)
    by_own &= ~cpu_bound | (_rise(work, best_k) >= s.shift_busy_share * rise)
    rel_cpu = chunked("rel_cpu", against(cpu, rows))
    by_cpu = np.zeros(len(rows), dtype=bool)
    if not np.isnan(rel_cpu).any() and np.nanmax(cpu) > 0:
        # Where own time does not show the rise plainly (too noisy, or certain but a hair short of
        # ``shift_min_rise``): the CPU time can (``shift_cpu_min_t``, ``shift_cpu_min_rise``).
        cpu_t, cpu_k = _best_split(rel_cpu, s.shift_min_after)
        cpu_rise = _rise(rel_cpu, cpu_k)
        by_cpu = ~by_own & (cpu_t >= s.shift_cpu_min_t) & (cpu_rise >= s.shift_cpu_min_rise)
        best_k = np.where(by_cpu, cpu_k, best_k)
    out = []
    chunk_steps, chunk_start = g.chunk_steps(c), g.chunk_starts(c)
    for j in np.flatnonzero(by_own | by_cpu):
        i, k = int(rows[j]), int(best_k[j])
        before, after = float(rel[i, :k].mean()), float(rel[i, k:].mean())
        peers = (np.arange(len(g.ranks)) != i) & ~skip
        peer_after = float(np.median(rel[peers, k:].mean(axis=1)))
        peer_before = float(np.median(rel[peers, :k].mean(axis=1)))
        # A pair's series is relative to the other rank already (which falls as much as it rises).
        level, was = (after, before) if pair else (after / peer_after, before / peer_before)
        # Still up at the end: judged on the series that found it (own time is the noisier).
        series = rel_cpu[j] if by_cpu[j] else rel[i]
        s_before, s_after, s_last = series[:k].mean(), series[k:].mean(), series[-3:].mean()
        if (
            (by_cpu[j] and after - before < s.shift_min_rise / 2)
            or level < s.shift_min_level
            or s_last - s_before < (s_after - s_before) / 2
        ):
            continue
        cols_after = g.chunk >= k
        cols = [col for col in COLUMNS if col in g.values]
        mean = {col: nanmean_rows(g.values[col][:, cols_after]) for col in cols}
        pm = {col: float(np.nanmedian(mean[col][peers])) for col in cols}
        out.append(
            _straggler(
                int(g.ranks[i]),
                {col: float(mean[col][i]) for col in cols},
                pm,
                chunks_flagged=c - k,
                chunks=c - k,  # the chunks since the change: it is slow in all of them
                ratio=level,
                since_step=int(chunk_start[k]),
                held_steps=int(chunk_steps[k:].sum()),
                before_ratio=was,
                cpu_growth=float(s_after / s_before) if by_cpu[j] else 0.0,
            )
        )
    return out


def _rise(series: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Per row of a rank x chunk series, its mean from chunk ``k`` of that row on less its mean before."""
    sums = np.cumsum(series, axis=1)
    head = sums[np.arange(series.shape[0]), k - 1]
    return (sums[:, -1] - head) / (series.shape[1] - k) - head / k


def _best_split(rel: np.ndarray, min_after: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a rank x chunk series, the split (first chunk after it, three before at least,
    ``min_after`` after) that maximizes the two-sample t of the rise, and that t."""
    c = rel.shape[1]
    best_t, best_k = np.full(rel.shape[0], -np.inf), np.zeros(rel.shape[0], dtype=np.int64)
    for k in range(3, c - min_after + 1):
        head, tail = rel[:, :k], rel[:, k:]
        rise = tail.mean(axis=1) - head.mean(axis=1)
        resid = np.concatenate(
            [head - head.mean(axis=1, keepdims=True), tail - tail.mean(axis=1, keepdims=True)], axis=1
        )
        sigma = np.maximum(np.sqrt((resid**2).sum(axis=1) / (c - 2)), 0.005)
        t = rise / (sigma * np.sqrt(1 / k + 1 / (c - k)))
        better = t > best_t
        best_t, best_k = np.where(better, t, best_t), np.where(better, k, best_k)
    return best_t, best_k
