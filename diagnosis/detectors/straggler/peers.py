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

from statistics import NormalDist

import numpy as np
import pandas as pd

from ...grid import OWN_PARTS, Grid, chunk_means, columns, grid, nanmean_rows, nanmedian, width, young
from ...robust import evenly, needed
from .rank import MAX_PEERS, Straggler, StragglerSettings, relative, straggler


def _flag(
    per: np.ndarray, s: StragglerSettings, min_ratio: float, exclude: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int]:
    """Per rank, in how many chunks (and which) its mean relative own time stands out against the
    median of the ranks not ``exclude``d; and how many chunks could be judged.

    From ``z_min_ranks`` ranks on, a chunk asks for ``min_z`` robust deviations as well as the
    ratio. A chunk of a job with long steps holds few of them (a 3-D job's ~1 s steps: ~10 a
    chunk), and its ranks' means spread by 5-8%: a rank whose upload blocks 15% of its own time
    every step passes the ratio in every chunk since, the deviations in two. So a rank above the
    ratio in enough chunks counts slow in them too where the chunks taken together say so: its
    mean over the chunks since the first of them passes the ratio, and its deviations, summed
    over every judged chunk and divided by the root of their number (one standard normal for a
    rank like the others), reach ``min_z``. (A rank steadily 6% slower by its cores passes the
    ratio in some chunks by chance, the sum of its deviations too, and its mean not.) Of more ranks
    than ``z_min_ranks``, the sum must be as rare among them as ``min_z`` is among that many: more
    ranks, more of them far out by chance (at 100,000, ~5.5 deviations)."""
    flagged = np.zeros(per.shape[0], dtype=np.int64)
    slow_in = np.zeros(per.shape, dtype=bool)
    above = np.zeros(per.shape, dtype=bool)
    z_sum = np.zeros(per.shape[0])
    meds = np.full(per.shape[1], np.nan)
    n_chunks = z_chunks = 0
    for c in range(per.shape[1]):
        col = per[:, c]
        valid = ~np.isnan(col)
        base = col[valid & ~exclude]
        if valid.sum() < 3 or base.size < 3:
            continue
        n_chunks += 1
        med = meds[c] = float(np.median(base))
        mad = float(np.median(np.abs(base - med))) * 1.4826
        scale = max(mad, s.mad_floor * abs(med), 1e-9)
        with np.errstate(invalid="ignore"):
            slow = above[:, c] = col >= min_ratio * med
            if base.size >= s.z_min_ranks:
                z = np.where(valid, (col - med) / scale, 0.0)
                z_sum += z
                z_chunks += 1
                slow = slow & (z >= s.min_z)
        flagged += slow
        slow_in[:, c] = slow
    if z_chunks:
        need = needed(n_chunks, s.persistence)
        since = np.arange(per.shape[1]) >= np.argmax(above, axis=1)[:, None]
        level = nanmean_rows(np.where(since, per / np.where(meds > 0, meds, np.nan), np.nan))
        z_min = _as_rare(s.min_z, s.z_min_ranks, per.shape[0])
        taken = (above.sum(axis=1) >= need) & (level >= min_ratio) & (z_sum / np.sqrt(z_chunks) >= z_min)
        more = taken & (flagged < need) & ~exclude
        flagged = np.where(more, above.sum(axis=1), flagged)
        slow_in[more] = above[more]
    return flagged, slow_in, n_chunks


def _as_rare(z: float, among: int, ranks: int) -> float:
    """The deviation one of ``ranks`` standard normals passes as rarely as one of ``among`` passes ``z``."""
    if ranks <= among:
        return z
    return NormalDist().inv_cdf(1.0 - NormalDist().cdf(-z) * among / ranks)


def slower_than_peers(
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

    def by_role(values: np.ndarray) -> np.ndarray:
        """Each rank's values over its role's median on each step."""
        if not roles:
            return relative(values)
        out = np.empty_like(values)
        for k in np.unique(role):
            out[role == k] = relative(values[role == k])
        return out

    g.values["rel"] = by_role(g.values["own_us"])
    per = chunk_means(g, "rel", s.chunks)
    flagged, slow_in, n_chunks = _flag(per, s, s.min_ratio, np.zeros(len(g.ranks), dtype=bool))
    is_culprit = flagged >= needed(n_chunks, s.persistence)
    cpu = g.values["cpu_us"]
    if np.nanmax(cpu, initial=0.0) > 0:
        g.values["rel_cpu"] = by_role(cpu)
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
                straggler(int(g.ranks[i]), mine, pm, ratio=mine["rel"] / max(pm["rel"], 1e-9), **how)
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
                straggler(int(g.ranks[i]), mine, peer, ratio=mine["rel"] / max(peer["rel"], 1e-9), **how)
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
