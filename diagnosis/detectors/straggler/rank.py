"""A straggler against its peers: the settings both rules read, the straggler they find, and each
step's median over the peers that makes a rank's values relative."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rankscope.wire.settings import check_numbers

from ...findings import effect
from ...grid import nanmedian
from ...robust import evenly


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
    a ticket waits 15 s anyway (``api.tickets.TicketSettings.open_after_s``)."""
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
    """The fewest steps a fine chunk holds (fewer chunks where the range is short)."""
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

    def __post_init__(self) -> None:
        check_numbers(self)


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


def step_median(values: np.ndarray, among: np.ndarray | None = None) -> np.ndarray:
    """Each step's (column's) median over the ranks ``among`` (a row mask; all ranks if None), of
    ``MAX_PEERS`` of them evenly spread where there are more: as exact, and 25x cheaper at 100,000."""
    rows = evenly(np.arange(values.shape[0]) if among is None else np.flatnonzero(among), MAX_PEERS)
    return nanmedian(values[rows] if rows.size < values.shape[0] else values, axis=0)


def relative(
    values: np.ndarray, among: np.ndarray | None = None, rows: np.ndarray | None = None
) -> np.ndarray:
    """rank x step ``values`` (of the ranks at ``rows`` only, if given) over each step's median of
    the ranks ``among`` (a row mask; all ranks if None), so that what the whole job does on a step
    cancels."""
    return (values if rows is None else values[rows]) / np.clip(step_median(values, among), 1.0, None)[
        None, :
    ]


def straggler(rank: int, own: dict[str, float], peer: dict[str, float], **how: Any) -> Straggler:
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
