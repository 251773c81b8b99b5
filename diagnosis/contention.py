"""Which ranks' CPUs are contended, from their threads' run-queue wait in the profiling windows.

A process sharing a rank's cores (another job, a preprocessing daemon, a runaway logger) need not
slow the training thread: a thread waking from a sleep preempts a busy intruder at once. The
threads that move the collectives' data and load batches are the ones that queue, and then every
peer waits for this rank inside the collectives — step time grows everywhere, own time nowhere.
The hook's ``cpu_wait@sched`` pattern is the time the rank's threads spent runnable but waiting
for a CPU during the window (``profiler_hook.schedstat``). Per window each rank's wait per step is
compared with the other ranks' (median / MAD); a rank that waits much longer in most windows, by a
share of the step time that matters, is contended.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from wire.records import WAIT_KIND, WAIT_PATTERN

from .robust import needed, spread
from .stragglers import width


@dataclass(frozen=True, slots=True, kw_only=True)
class ContentionSettings:
    min_ratio: float = 1.4
    """A rank's CPU wait per step must exceed the ranks' median by this factor (healthy 4-rank jobs
    on 2 oversubscribed cores reach 1.33x in single windows)..."""
    min_step_share: float = 0.1
    """...and by this share of the window's median step time (summed over threads: a wait that
    short cannot be what holds the job back)..."""
    min_z: float = 5.0
    """...and by this many robust standard deviations (from ``z_min_ranks`` ranks on)."""
    z_min_ranks: int = 8
    mad_floor: float = 0.05
    """The robust deviation is never taken below this fraction of the median."""
    peel_ratio: float = 1.5
    """Once contended ranks are found, another is one too if its wait exceeds the median of the
    ranks not found by this factor (stricter than ``min_ratio``): the contended ranks of one host
    lift the median of a small job's ranks, and two contended ranks of four wait ~2.3x the others'
    but only ~1.4x the median of all four."""
    persistence: float = 0.5
    """A contended rank must stand out in at least this fraction of the windows since the first
    in which it did (contention starts when the intruder does), and in two at least."""
    waited_for: float = 1.1
    """A contended rank that is no straggler is left out when a straggler's collective wait per step
    is under its own by this factor: the job waits for that straggler, not for it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Contended:
    rank: int
    wait_us: float
    """The rank's CPU wait per step, all threads (median over the windows)."""
    peer_wait_us: float
    step_us: float
    """The job's median step time in those windows."""
    ratio: float
    windows_flagged: int
    windows: int
    since_step: int = 0
    """The first step of the first window it stood out in."""

    @property
    def step_share(self) -> float:
        """The extra wait as a share of the step time."""
        return (self.wait_us - self.peer_wait_us) / max(self.step_us, 1.0)


def _window_step_us(functions: pd.DataFrame, steps: pd.DataFrame) -> pd.Series:
    """Median step time over all ranks of each window's steps, indexed by window."""
    spans = functions[["window", "step_lo", "step_hi"]].drop_duplicates("window")
    if steps.empty:
        return pd.Series(np.nan, index=spans["window"])
    per_step = steps.groupby("step")["dur_us"].median()
    w = width(steps) - 1  # rows that start this many steps before a window overlap it
    return pd.Series(
        [
            float(per_step.loc[lo - w : max(lo, hi - 1)].median())
            for lo, hi in zip(spans["step_lo"], spans["step_hi"], strict=True)
        ],
        index=spans["window"],
    )


def find(
    functions: pd.DataFrame, steps: pd.DataFrame, s: ContentionSettings | None = None
) -> list[Contended]:
    """Ranks whose threads persistently wait for a CPU much longer than their peers'."""
    s = s or ContentionSettings()
    if functions.empty:
        return []
    f = functions[(functions["kind"] == WAIT_KIND) & (functions["name"] == WAIT_PATTERN)]
    if f.empty:
        return []
    step_us = _window_step_us(f, steps)
    f = pd.DataFrame(
        {
            "rank": f["rank"].astype(np.int64),
            "window": f["window"],
            "w": f["total_us"].astype(float) / (f["step_hi"] - f["step_lo"]).clip(lower=1),
        }
    )
    f["step_us"] = f["window"].map(step_us)
    found = _persistent(_flag(f, f, s, s.min_ratio), s)
    if found and f["rank"].nunique() - len(found) >= 3:
        # Half a small job's ranks contended (one host of two) lift the median the others are
        # measured against: measured against the ranks not found, at a stricter ratio.
        known = {c.rank for c in found}
        rest = f[~f["rank"].isin(known)]
        found += [c for c in _persistent(_flag(rest, f, s, s.peel_ratio), s) if c.rank not in known]
    return sorted(found, key=lambda c: c.rank)


def _flag(peers: pd.DataFrame, f: pd.DataFrame, s: ContentionSettings, ratio: float) -> pd.DataFrame:
    """``f``'s rows with ``slow`` (this window, this rank waits much longer than the median of
    ``peers``), ``peer`` (that median) and ``ratio``."""
    med, scale, n = spread(peers["w"], peers["window"], s.mad_floor, 1e-9)
    by_window = pd.DataFrame({"window": peers["window"], "med": med, "scale": scale, "n": n}).drop_duplicates(
        "window"
    )
    f = f.merge(by_window, on="window", how="inner")
    slow = (
        (f["w"] >= ratio * f["med"]) & (f["n"] >= 3) & (f["w"] - f["med"] >= s.min_step_share * f["step_us"])
    )
    slow &= ((f["w"] - f["med"]) / f["scale"] >= s.min_z) | (f["n"] < s.z_min_ranks)
    return f.assign(slow=slow, peer=f["med"], ratio=f["w"] / f["med"].clip(lower=1.0))


def _persistent(f: pd.DataFrame, s: ContentionSettings) -> list[Contended]:
    """The ranks of ``f`` (flagged by :func:`_flag`) slow in enough windows since their first."""
    suspects = f.loc[f["slow"], "rank"].unique()
    if suspects.size == 0:
        return []
    f = f[f["rank"].isin(suspects)]
    first = f[f["slow"]].groupby("rank")["window"].min()
    f = f[f["window"] >= f["rank"].map(first)]
    per = f.groupby("rank").agg(
        flagged=("slow", "sum"),
        windows=("slow", "size"),
        since=("window", "min"),
        w=("w", "median"),
        peer=("peer", "median"),
        ratio=("ratio", "median"),
        step_us=("step_us", "median"),
    )
    out = []
    for rank, r in per.iterrows():
        windows = int(r["windows"])
        if int(r["flagged"]) < needed(windows, s.persistence):
            continue
        out.append(
            Contended(
                rank=int(rank),
                wait_us=float(r["w"]),
                peer_wait_us=float(r["peer"]),
                step_us=float(r["step_us"]),
                ratio=float(r["ratio"]),
                windows_flagged=int(r["flagged"]),
                windows=windows,
                since_step=int(r["since"]),
            )
        )
    return out
