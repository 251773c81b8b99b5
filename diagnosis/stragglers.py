"""Which ranks hold the job back, from the always-on step rows.

The wait inversion: in synchronous training every rank leaves each collective at the same time, so
a slow rank's peers show LONG collectives (they wait for it) and the culprit the shortest. Raw
step or collective time therefore points at the wrong ranks. What a rank spends *outside* the
collectives — its own time, ``dur - comm`` — is what separates the culprit: it is the largest on
the rank everybody waits for.

Per chunk of consecutive steps, each rank's own time relative to the other ranks' on the same
steps is compared across ranks with a robust z-score (median / MAD). A rank that stands out in most chunks is a straggler; the
part of its own time that exceeds its peers (data wait, or compute) gives the first cause.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    warmup_steps: int = 10
    """Steps skipped at the start of the analyzed range (first-iteration allocation, JIT)."""
    last_steps: int = 3000
    """Only the most recent this-many steps are analyzed."""
    chunks: int = 6
    """The analyzed steps are split into this many consecutive chunks."""
    min_ratio: float = 1.10
    """A rank's own time must exceed the step's median by this factor to count as slow in a chunk."""
    min_z: float = 3.5
    """...and by this many robust standard deviations."""
    z_min_ranks: int = 8
    """The z-score test applies from this many ranks on; below, a MAD is too unstable to use."""
    mad_floor: float = 0.03
    """The robust deviation is never taken below this fraction of the median (quiet jobs)."""
    persistence: float = 0.5
    """A straggler must be slow in at least this fraction of the chunks."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Straggler:
    rank: int
    chunks_flagged: int
    chunks: int
    ratio: float
    """Median over steps of (own time / that step's median own time), relative to the peers'."""
    own_us: float
    """The rank's median own time per step (step time minus time inside collectives)."""
    peer_own_us: float
    data_us: float
    peer_data_us: float
    comm_us: float
    peer_comm_us: float
    cpu_us: float
    peer_cpu_us: float
    nivcsw: float
    peer_nivcsw: float

    @property
    def excess_us(self) -> float:
        return self.own_us - self.peer_own_us


def prepare(steps: pd.DataFrame, s: Settings) -> pd.DataFrame:
    """The analyzed steps with derived columns and a chunk number."""
    if steps.empty:
        return steps.assign(own_us=[], chunk=[])
    lo = int(steps["step"].min()) + s.warmup_steps
    hi = int(steps["step"].max())
    lo = max(lo, hi - s.last_steps + 1)
    df = steps[(steps["step"] >= lo) & (steps["step"] <= hi)].copy()
    df["own_us"] = (df["dur_us"] - df["comm_us"]).clip(lower=0)
    span = max(hi - lo + 1, 1)
    df["chunk"] = ((df["step"] - lo) * s.chunks // span).clip(upper=s.chunks - 1)
    return df


def robust_z(values: pd.Series, floor_frac: float) -> tuple[pd.Series, float]:
    """(z-scores, median): median/MAD, the scale never below ``floor_frac`` x median."""
    med = float(values.median())
    mad = float((values - med).abs().median()) * 1.4826
    scale = max(mad, floor_frac * abs(med), 1e-9)
    return (values - med) / scale, med


def find(steps: pd.DataFrame, s: Settings | None = None) -> list[Straggler]:
    """Ranks whose own time per step persistently exceeds their peers'.

    Each step's own times are divided by that step's median over the ranks first: machine-wide
    noise (a busy neighbour, a slow step for everybody) cancels, and what is left is how much
    longer this rank worked than the others on the very same step.
    """
    s = s or Settings()
    df = prepare(steps, s)
    if df.empty or df["rank"].nunique() < 3:
        return []  # two ranks cannot outvote each other
    step_med = df.groupby("step")["own_us"].transform("median").clip(lower=1.0)
    df = df.assign(rel=df["own_us"] / step_med)
    per = df.groupby(["chunk", "rank"])["rel"].median().reset_index()
    flagged: dict[int, int] = {}
    n_chunks = 0
    for _, g in per.groupby("chunk"):
        if len(g) < 3:
            continue
        n_chunks += 1
        z, med = robust_z(g["rel"], s.mad_floor)
        slow = g["rel"] >= s.min_ratio * med
        if len(g) >= s.z_min_ranks:
            slow &= z >= s.min_z
        slow = g[slow]
        for r in slow["rank"].astype(int):
            flagged[r] = flagged.get(r, 0) + 1
    need = max(2, int(np.ceil(s.persistence * n_chunks))) if n_chunks > 1 else 1
    culprits = sorted(r for r, n in flagged.items() if n >= need)
    if not culprits:
        return []
    cols = ["rel", "own_us", "data_us", "comm_us", "cpu_us", "nivcsw"]
    med = df.groupby("rank")[cols].median()
    peers = med.drop(index=culprits, errors="ignore")
    if peers.empty:
        return []  # everybody is "slow": that is a job-wide question, not a straggler
    pm = peers.median()
    return [
        Straggler(
            rank=r,
            chunks_flagged=flagged[r],
            chunks=n_chunks,
            ratio=float(med.at[r, "rel"] / max(pm["rel"], 1e-9)),
            own_us=float(med.at[r, "own_us"]),
            peer_own_us=float(pm["own_us"]),
            data_us=float(med.at[r, "data_us"]),
            peer_data_us=float(pm["data_us"]),
            comm_us=float(med.at[r, "comm_us"]),
            peer_comm_us=float(pm["comm_us"]),
            cpu_us=float(med.at[r, "cpu_us"]),
            peer_cpu_us=float(pm["cpu_us"]),
            nivcsw=float(med.at[r, "nivcsw"]),
            peer_nivcsw=float(pm["nivcsw"]),
        )
        for r in culprits
    ]
