"""A rank that became slower than it was, against its peers: the change-point rule."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import numpy as np
import pandas as pd

from ...grid import COLUMNS, Grid, chunk_means, columns, grid, nanmean_rows, young
from .rank import Straggler, StragglerSettings, relative, step_median, straggler


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
            return relative(values, ~skip, rows)
        at = np.arange(2) if rows is None else rows
        return values[at] / np.clip(values[1 - at], 1.0, None)

    # Relative to the other ranks' median: a straggler found already would lift it on every step.
    peer_own = np.clip(own[::-1] if pair else step_median(own, ~skip)[None, :], 1.0, None)
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
            straggler(
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
