"""``hang``: a job that stopped making progress, and the ranks it waits for — from the latest
heartbeats, in seconds rather than at the watchdog timeout.

Every rank's heartbeat carries, per process group, the sequence number of the last collective it
entered (as Flight Recorder does). When the job stops making progress, the ranks that never
entered the collective the others wait in — a lower last sequence number — are the culprits; a
rank whose heartbeats stopped altogether is dead or frozen. The culprit's stack says where it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pandas as pd

from ..data import JobData
from ..findings import Finding

MAX_LISTED = 64
"""Up to this many ranks, the evidence lists every rank's last sequence number and step."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    stall_s: float = 30.0
    """The job is hung when some rank made no progress for this long."""
    silent_s: float = 30.0
    """A rank whose latest heartbeat is this much older than the newest one is silent."""


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


def _seq(last_seq: Any, group: str) -> int:
    if isinstance(last_seq, dict):
        return int(last_seq.get(group, 0))
    try:  # ClickHouse maps come back as dicts; tolerate lists of pairs
        return int(dict(last_seq).get(group, 0))
    except (TypeError, ValueError):
        return 0


def find(data: JobData, s: Settings) -> list[Finding]:
    """The hang, if the job has one: one finding naming the ranks it waits for and where they are."""
    h = locate(data.heartbeats, s)
    return [_finding(h, data.hosts_of(h.ranks))] if h is not None else []


def locate(heartbeats: pd.DataFrame, s: Settings | None = None) -> Hang | None:
    """The hang the latest heartbeats show, or None while every rank makes progress."""
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
    silent = hb[silent_age >= s.silent_s]
    waiting = hb[hb["coll_seq"] >= 0]
    group, seq = "", -1
    if not waiting.empty:
        top = waiting.sort_values(by="coll_seq").iloc[-1]
        group, seq = str(top["coll_group"]), int(top["coll_seq"])
    last = pd.Series([_seq(x, group) for x in hb["last_seq"]], index=hb.index, dtype="int64")
    behind = hb[last < seq] if seq >= 0 else hb.iloc[0:0]
    culprits = sorted(set(behind["rank"].astype(int)) | set(silent["rank"].astype(int)))
    if culprits:
        why = (
            f"ranks {culprits} never entered collective #{seq} of group '{group}' that "
            f"{len(waiting)} rank(s) wait in"
            if seq >= 0 and not behind.empty
            else f"ranks {culprits} stopped sending heartbeats"
        )
    else:  # all in the same collective: the transport itself is stuck
        culprits = sorted(stalled["rank"].astype(int))
        why = f"all stalled ranks wait in collective #{seq} of group '{group}'"
    mine = hb["rank"].isin(culprits)
    stacks = {
        int(r): str(st) for r, st in zip(hb.loc[mine, "rank"], hb.loc[mine, "stack"], strict=True) if st
    }
    # Every rank's numbers for a small job; at scale the culprits' and how many ranks are where.
    shown = hb["rank"].isin(culprits) | (len(hb) <= MAX_LISTED)
    ranks = hb.loc[shown, "rank"].astype(int)
    return Hang(
        ranks=culprits,
        stalled=sorted(stalled["rank"].astype(int)),
        group=group,
        seq=seq,
        why=why,
        stacks=stacks,
        evidence={
            "stalled_for_s": round(float(age.max()), 1),
            "waiting_in": {"group": group, "seq": seq},
            "last_seq": dict(zip(ranks, last[shown].astype(int), strict=True)),
            "last_step": dict(zip(ranks, hb.loc[shown, "step"].astype(int), strict=True)),
            "ranks_by_last_seq": {int(k): int(v) for k, v in last.value_counts().sort_index().items()},
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
