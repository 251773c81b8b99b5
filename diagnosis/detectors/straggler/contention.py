"""Which ranks' CPUs are contended, from their threads' run-queue wait in the profiling windows.

A process sharing a rank's cores (another job, a preprocessing daemon, a runaway logger) need not
slow the training thread: a thread waking from a sleep preempts a busy intruder at once. The
threads that move the collectives' data and load batches are the ones that queue, and then every
peer waits for this rank inside the collectives — step time grows everywhere, own time nowhere.
The hook's ``cpu_wait@sched`` pattern is the time the rank's threads spent runnable but waiting
for a CPU during the window (``profiler_hook.schedstat``). Per window each rank's wait per step is
compared with the other ranks' (median / MAD); a rank that waits much longer in most windows, by a
share of the step time that matters, is contended — if its windows rank above the others' by more
than chance allows: on cores shared by many ranks' threads, each healthy rank's wait per step
swings 0.2-5x the median from one window to the next.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pandas as pd

from rankscope.wire.records import WAIT_KIND, WAIT_PATTERN
from rankscope.wire.settings import check_numbers

from ... import grid
from ...robust import evenly, needed, spread
from .rank import MAX_PEERS, StragglerSettings


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
    """Below this many ranks in a window the deviation test is left out: their spread says too little."""
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
    max_p: float = 0.001
    """...and its waits must rank above those of the ranks not contended by more than chance
    allows: at most this one-sided p-value (Mann-Whitney U on the ratios to the median, the ranks
    of one host pooled: a hog on a host's cores slows all of its ranks). A healthy rank whose
    threads happen to queue longest in two windows running is no finding (a 1 in 28 chance among
    four ranks: a 20-minute healthy job had it at 108 s); the service asks again at every cycle."""
    step_ratio: float = 2.0
    """The training thread's wait per step (always on) against that of the ranks of other hosts,
    chunk by chunk (``chunks``): healthy jobs' ranks reached 1.64x in chunks of 130 steps on 2
    shared cores, those of a host with CPU hogs 3.5-7x."""
    chunks: StragglerSettings = field(default_factory=StragglerSettings)
    """How the steps are read for it: the last ``last_steps`` after the warm-up, in ``chunks``
    chunks, from the job's ``min_s``-th second (the stragglers' cut)."""
    waited_for: float = 1.1
    """A contended rank that is no straggler is left out when a straggler's collective wait per step
    is under its own by this factor: the job waits for that straggler, not for it."""

    def __post_init__(self) -> None:
        check_numbers(self)


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
    """The first step of the first window (or chunk of steps) it stood out in."""
    measured: Literal["windows", "steps"] = "windows"
    """From all its threads' wait in the profiling windows, or its training thread's at every step
    (``windows_flagged`` and ``windows`` are then chunks of steps)."""

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
    w = grid.width(steps) - 1  # rows that start this many steps before a window overlap it
    return pd.Series(
        [
            float(per_step.loc[lo - w : max(lo, hi - 1)].median())
            for lo, hi in zip(spans["step_lo"], spans["step_hi"], strict=True)
        ],
        index=spans["window"],
    )


def find(
    functions: pd.DataFrame,
    steps: pd.DataFrame,
    s: ContentionSettings | None = None,
    hosts: dict[int, str] | None = None,
    roles: list[list[int]] | None = None,
) -> list[Contended]:
    """Ranks whose threads persistently wait for a CPU much longer than their peers': their
    training thread at every step, or all their threads in the profiling windows (``hosts``:
    each rank's host, where known). Of a job whose ranks have roles (``JobData.roles``: pipeline
    stages), each rank against those of its role: a pipeline's stages wait for a CPU differently
    by design, and where each host holds one stage (DeepSpeed's pipeline on two hosts), comparing
    hosts compared stages (a healthy run's first stage named a contended host)."""
    if roles is not None and len(roles) > 1:
        return sorted(
            (
                c
                for group in roles
                for c in find(
                    functions[functions["rank"].isin(group)], steps[steps["rank"].isin(group)], s, hosts
                )
            ),
            key=lambda c: c.rank,
        )
    s = s or ContentionSettings()
    hosts = hosts or {}
    found = {c.rank: c for c in _from_windows(functions, steps, s, hosts)}
    return sorted(
        {**{c.rank: c for c in _from_steps(steps, s, hosts)}, **found}.values(), key=lambda c: c.rank
    )


def _from_windows(
    functions: pd.DataFrame, steps: pd.DataFrame, s: ContentionSettings, hosts: dict[int, str]
) -> list[Contended]:
    """The ranks whose threads, all of them, wait for a CPU much longer than the others' in most
    windows, beyond chance."""
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
    return _beyond_chance(found, f, s, hosts)


def _from_steps(steps: pd.DataFrame, s: ContentionSettings, hosts: dict[int, str]) -> list[Contended]:
    """The ranks whose training thread waits for a CPU ``step_ratio`` times as long per step as
    the ranks of the other hosts (of the job's other ranks, on one host) in most chunks of the
    analyzed steps since it first did, by ``min_step_share`` of the step at least: always on, at
    every step, where the windows come every few tens of seconds."""
    if "wait_us" not in steps or steps.empty:
        return []
    g = grid.grid(steps, s.chunks, ["wait_us", "dur_us"])
    if g is None or g.steps < s.chunks.chunks * s.chunks.min_chunk_steps or grid.young(steps, g, s.chunks):
        return []
    wait = grid.chunk_medians(g, "wait_us", s.chunks.chunks)  # rank x chunk
    dur = grid.nanmedian(grid.chunk_medians(g, "dur_us", s.chunks.chunks), axis=0)
    ref = _reference(wait, np.array([hosts.get(int(r), "") for r in g.ranks]))
    flagged = (wait >= s.step_ratio * ref) & (wait - ref >= s.min_step_share * dur[None, :])
    starts = g.chunk_starts(s.chunks.chunks)
    out = []
    for i in np.flatnonzero(flagged.any(axis=1)):  # a few ranks at most
        first = int(np.argmax(flagged[i]))
        since, held = slice(first, None), flagged[i, first:]
        if int(held.sum()) < needed(held.size, s.persistence):
            continue
        out.append(
            Contended(
                rank=int(g.ranks[i]),
                wait_us=float(np.nanmedian(wait[i, since])),
                peer_wait_us=float(np.nanmedian(ref[i, since])),
                step_us=float(np.nanmedian(dur[since])),
                ratio=float(np.nanmedian(wait[i, since] / ref[i, since])),
                windows_flagged=int(held.sum()),
                windows=int(held.size),
                since_step=int(starts[first]),
                measured="steps",
            )
        )
    return out


def _reference(wait: np.ndarray, host: np.ndarray) -> np.ndarray:
    """rank x chunk: what each rank's wait is measured against — the median of the ranks of the
    other hosts (of ``MAX_HOSTS`` hosts or fewer: one host's ranks share its hogs), of all other
    ranks on one host, or of the job's ranks (evenly spread) where a host is a small part of it.
    NaN where fewer than two ranks make it; never under 1 µs."""
    if np.unique(host).size == 1 or (host == "").any():  # one host, or hosts unknown: each rank alone
        host = np.arange(wait.shape[0]).astype(str)
    names = np.unique(host)
    if names.size > MAX_HOSTS:
        rows = evenly(np.arange(wait.shape[0]), MAX_PEERS)
        return np.maximum(np.broadcast_to(grid.nanmedian(wait[rows], axis=0), wait.shape), 1.0)
    ref = np.full(wait.shape, np.nan)
    for name in names:
        mine = host == name
        if (~mine).sum() >= 2:
            ref[mine] = grid.nanmedian(wait[~mine], axis=0)
    return np.maximum(ref, 1.0)


MAX_HOSTS = 16
"""Up to this many hosts (ranks, on one host) each is measured against the others exactly;
beyond, against the job's median, which one host's ranks barely move."""


def _beyond_chance(
    found: list[Contended], f: pd.DataFrame, s: ContentionSettings, hosts: dict[int, str]
) -> list[Contended]:
    """Those of ``found`` whose waits in the windows read rank above the other ranks' beyond
    chance (``max_p``), the found ranks of one host tested together. All windows read, not those
    since a rank first stood out: chosen for standing out, they would make chance look like a
    finding at one cycle or another of a long job's."""
    if not found:
        return []
    ratio = np.log(f["w"].clip(lower=1e-9) / f.groupby("window")["w"].transform("median").clip(lower=1e-9))
    f = f.assign(ratio=ratio)
    others = f[~f["rank"].isin([c.rank for c in found])]
    groups: dict[str, list[Contended]] = {}
    for c in found:
        groups.setdefault(hosts.get(c.rank, f"rank {c.rank}"), []).append(c)
    out = []
    for group in groups.values():
        x = f.loc[f["rank"].isin([c.rank for c in group]), "ratio"]
        if mann_whitney_p(x.to_numpy(), others["ratio"].to_numpy()) <= s.max_p:
            out += group
    return out


def mann_whitney_p(x: np.ndarray, y: np.ndarray) -> float:
    """One-sided p-value that ``x`` ranks above ``y`` by chance: Mann-Whitney U, exact (its null
    distribution without ties; tied values share their ranks, and a half U counts down). Samples
    beyond ``MAX_SAMPLE`` are cut to that many of their quantiles."""
    x, y = (evenly(np.sort(v), MAX_SAMPLE) for v in (x, y))
    m, n = x.size, y.size
    if m == 0 or n == 0:
        return 1.0
    ranks = pd.Series(np.concatenate([x, y])).rank().to_numpy()
    u = math.floor(ranks[:m].sum() - m * (m + 1) / 2)
    counts = _u_counts(m, n)
    return float(counts[u:].sum() / counts.sum())


MAX_SAMPLE = 64


@functools.lru_cache(maxsize=32)
def _u_counts(m: int, n: int) -> np.ndarray:
    """How many orderings of ``m`` values above or below ``n`` others give each U (0 to m n): the
    largest of i + j values is one of the i (it is above all j: U gains j) or one of the j."""
    size = m * n + 1
    prev = np.zeros((n + 1, size))
    prev[:, 0] = 1.0  # no x values: U is 0, one way
    for _ in range(m):
        cur = np.zeros_like(prev)
        cur[0, 0] = 1.0
        for j in range(1, n + 1):
            cur[j, j:] = prev[j, : size - j]
            cur[j] += cur[j - 1]
        prev = cur
    return prev[n]


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
