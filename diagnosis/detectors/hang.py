"""``hang``: a job that stopped making progress, and the ranks it waits for — from the latest
heartbeats, in seconds rather than at the watchdog timeout.

Every rank's heartbeat carries, per process group, the sequence number of the last collective it
entered (as Flight Recorder does), and the call it waits in (a point-to-point one with its peer).
When the job stops making progress, the ranks the waiting ones wait for — followed from rank to
rank — that wait for no one are the culprits: in a collective, the members of its group that never
entered it (a lower last sequence number); in a ``send`` or ``recv``, the peer. A rank whose
heartbeats stopped altogether is dead or frozen. The culprit's stack says where it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pandas as pd

from rankscope.wire.settings import check_numbers

from ..data import JobData
from ..findings import Finding
from ..gpu_faults import gpu_faults

MAX_LISTED = 64
"""Up to this many ranks, the evidence lists every rank's last sequence number and step."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    stall_s: float = 30.0
    """The job is hung when some rank made no progress for this long."""
    silent_s: float = 30.0
    """A rank whose latest heartbeat is this much older than the newest one is silent."""

    def __post_init__(self) -> None:
        check_numbers(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Hang:
    ranks: list[int]
    stalled: list[int]
    """All ranks without progress (the culprits and those waiting for them)."""
    group: str
    seq: int
    """The collective (process group, sequence number) the waiting ranks are in."""
    why: str
    stacks: dict[int, str]
    evidence: dict[str, Any]


def _seqs(last_seq: Any) -> dict[str, int]:
    """A heartbeat's ``last_seq``: per group the rank belongs to, its last collective's number."""
    try:  # ClickHouse maps come back as dicts; tolerate lists of pairs
        return {str(g): int(n) for g, n in dict(last_seq).items()}
    except (TypeError, ValueError):
        return {}


def find(data: JobData, s: Settings) -> list[Finding]:
    """The hang, if the job has one: one finding naming the ranks it waits for and where they are."""
    h = locate(data.heartbeats, s)
    return [_finding(h, data.hosts_of(h.ranks))] if h is not None else []


def locate(heartbeats: pd.DataFrame, s: Settings | None = None) -> Hang | None:
    """The hang the latest heartbeats show, or None while every rank makes progress.

    Each waiting rank waits for someone: in a collective, for the members of its group (those
    whose numbers name the group) that never entered it; in a ``send`` or ``recv``, for its peer.
    Followed from rank to rank, the waits end at the ranks that wait for no one (stuck in their
    own code) or have fallen silent: the culprits. A collective's number is its group's: in a job
    of several groups (a pipeline's stages, its data-parallel replicas) ranks wait in different
    groups at different numbers, and each is compared only with the members of its own."""
    s = s or Settings()
    if heartbeats.empty:
        return None
    hb = heartbeats.sort_values(by="rank")
    newest = float(hb["time_us"].max())
    silent_age = (newest - hb["time_us"]) / 1e6
    age = hb["progress_age_s"] + silent_age
    stalled = hb[age >= s.stall_s]
    if stalled.empty:
        return None
    silent = set(hb.loc[silent_age >= s.silent_s, "rank"].astype(int))
    ranks = hb["rank"].astype(int).tolist()
    seqs = {r: _seqs(x) for r, x in zip(ranks, hb["last_seq"], strict=True)}
    peer = hb["coll_peer"] if "coll_peer" in hb else pd.Series(-1, index=hb.index)
    members: dict[str, list[tuple[int, int]]] = {}
    for r, last in seqs.items():
        for g, n in last.items():
            members.setdefault(g, []).append((r, n))
    behind: dict[tuple[str, int], frozenset[int]] = {}
    """The members of a group that never entered its collective of a number, once per (group, number)."""
    waits: dict[int, tuple[str, int, str, frozenset[int]]] = {}
    """Per waiting rank: the group, number and op it waits in, and the ranks it waits for."""
    for r, group, op, seq, p in zip(
        ranks, hb["coll_group"], hb["coll_op"], hb["coll_seq"], peer, strict=True
    ):
        if seq < 0 or r in silent:
            continue
        group, seq = str(group), int(seq)
        if op in ("send", "recv") and int(p) >= 0:
            waits[r] = (group, seq, str(op), frozenset([int(p)]))
            continue
        if (group, seq) not in behind:
            behind[group, seq] = frozenset(m for m, n in members.get(group, ()) if n < seq)
        waits[r] = (group, seq, str(op), behind[group, seq])
    # Every rank some rank waits for is reached along the waits; those that wait for no one (or
    # are silent) are where the waits end: the culprits. One still in a collective every other
    # member has left (its own number behind theirs: a call launched from C++ before it stopped)
    # waits for no one either.
    waiting = {r for r, w in waits.items() if w[3]}
    culprits = set().union(*(w[3] for w in waits.values())) - waiting | silent
    group, seq, parts = "", -1, []
    held = sorted(culprits - silent)
    blamed = [(r, w) for r, w in waits.items() if w[3] & culprits]
    if blamed:  # the wait a culprit holds up directly (the one in the highest-numbered call)
        r, (group, seq, op, _) = max(blamed, key=lambda rw: rw[1][1])
    if blamed and held:
        parts.append(
            f"rank {r} waits in {op} #{seq} of group '{group}' for rank(s) {held}"
            if op in ("send", "recv")
            else f"ranks {held} never entered collective #{seq} of group '{group}' that {len(waits)} rank(s) wait in"
        )
    if silent:
        parts.append(f"ranks {sorted(silent)} stopped sending heartbeats")
    if not parts:  # all in the same collective, or waiting for each other: the transport is stuck
        culprits = set(stalled["rank"].astype(int))
        if waits:
            group, seq, *_ = max(waits.values(), key=lambda w: w[1])
        parts.append(f"all stalled ranks wait in collective #{seq} of group '{group}'")
    culprit_list = sorted(culprits)
    gpus = (
        {int(r): dict(x) for r, x in zip(hb["rank"], hb["gpu_xids"], strict=True) if x and int(r) in culprits}
        if "gpu_xids" in hb
        else {}
    )
    # A GPU that fell off the bus hangs its rank's collectives: its XIDs say why.
    parts += [f"rank {r}'s GPU since attach: {gpu_faults(x)}" for r, x in sorted(gpus.items())]
    why = "; ".join(parts)
    last = pd.Series([seqs[r].get(group, 0) for r in ranks], index=hb.index, dtype="int64")
    mine = hb["rank"].isin(culprit_list)
    stacks = {
        int(r): str(st) for r, st in zip(hb.loc[mine, "rank"], hb.loc[mine, "stack"], strict=True) if st
    }
    # Every rank's numbers for a small job; at scale the culprits' and how many ranks are where.
    shown = mine | (len(hb) <= MAX_LISTED)
    listed = hb.loc[shown, "rank"].astype(int)
    return Hang(
        ranks=culprit_list,
        stalled=sorted(stalled["rank"].astype(int)),
        group=group,
        seq=seq,
        why=why,
        stacks=stacks,
        evidence={
            "stalled_for_s": round(float(age.max()), 1),
            "waiting_in": {"group": group, "seq": seq},
            "last_seq": dict(zip(listed, last[shown].astype(int), strict=True)),
            "last_step": dict(zip(listed, hb.loc[shown, "step"].astype(int), strict=True)),
            "ranks_by_last_seq": {int(k): int(v) for k, v in last.value_counts().sort_index().items()},
            **({"gpu_xids": {str(r): x for r, x in sorted(gpus.items())}} if gpus else {}),
            **(
                {"waits_for": {str(r): sorted(w[3]) for r, w in waits.items()}}
                if len(waits) <= MAX_LISTED
                else {}
            ),
        },
    )


_LIBRARY_PATH = re.compile(r'File "(<[^"]*>|[^"]*(-packages/|/lib/python3[.\d]*/|/profiler_hook/)[^"]*)"')
"""A stack frame of the interpreter, the standard library, an installed package or the hook."""


def _finding(h: Hang, hosts: dict[int, str]) -> Finding:
    stack = next(iter(h.stacks.values()), "")
    frames = [ln.strip() for ln in stack.splitlines() if ln.strip().startswith("File ")]
    # Where the job's own code is stuck: its innermost frame (the library frames under it follow).
    own = [f for f in frames if not _LIBRARY_PATH.match(f)]
    where = (
        (own or frames)[-1] if frames else (f"collective #{h.seq} ({h.group})" if h.seq >= 0 else "unknown")
    )
    clear = bool(h.seq >= 0 and set(h.ranks) != set(h.stalled))
    return Finding(
        cause="hang",
        ranks=h.ranks,
        hosts=sorted({hosts[r] for r in h.ranks if r in hosts}),
        function=where,
        confidence=0.95 if clear else 0.6,
        summary=f"job hung: {h.why}",
        evidence={**h.evidence, "stacks": {str(k): v for k, v in h.stacks.items()}},
        scope="rank",
    )
