"""Which ranks' network link is slow, from per-rank transfer throughput in the profiling windows.

With ring or tree collectives one slow link slows every rank's collective alike, and a rank that
waits for a late peer spends that wait inside the collective too: neither step time nor a
collective's duration names the link. What does is a transfer measurement per rank — the bytes a
rank sent over the network and the time spent sending them, without the wait for peers, as NCCL's
profiler plugin reports per proxy step. Such patterns are ``collective`` rows named
``net_send@<group>`` with ``nbytes``. (The hook's wrapped ``torch.distributed`` calls, named
``<op>@<group>``, include the wait, so they are not used here: an early rank would look slow.)

Per window and pattern each rank's time per byte is compared with the other ranks' (median /
MAD); a rank that is slower in most windows is a communication culprit. The diagnosis then names
the NIC, host or switch when the culprits make up a whole one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

TRANSFER_PREFIX = "net_send@"
"""Collective patterns that time the network transfer alone."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CommSettings:
    min_ratio: float = 1.3
    """A rank's time per byte must exceed the peers' median by this factor..."""
    min_z: float = 5.0
    """...and by this many robust standard deviations (from ``z_min_ranks`` ranks on)."""
    z_min_ranks: int = 8
    mad_floor: float = 0.03
    """The robust deviation is never taken below this fraction of the median."""
    persistence: float = 0.5
    """A culprit must be slow in at least this fraction of the windows that saw it."""
    min_excess_us: float = 20_000.0
    """...and spend at least this much longer sending in the window than the peers' rate implies.
    Kernels count TCP busy time in jiffies (1-10 ms), so on a fast link a few ms are noise."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowLink:
    rank: int
    pattern: str
    ratio: float
    """The rank's time per byte over the peers' median (median over the windows)."""
    gbps: float
    """The rank's send throughput, GB/s (median over the windows)."""
    peer_gbps: float
    windows_flagged: int
    windows: int


def _per_call_us(f: pd.DataFrame) -> pd.Series:
    """The time of the pattern's executions: the median call's (a one-step spike moves only the mean)."""
    if "p50_us" in f:
        p50 = f["p50_us"].astype(float) * f["count"]
        return p50.where(p50 > 0, f["total_us"])
    return f["total_us"].astype(float)


def find(functions: pd.DataFrame, s: CommSettings | None = None) -> list[SlowLink]:
    """Ranks whose network send time per byte persistently exceeds their peers'."""
    s = s or CommSettings()
    if functions.empty or "nbytes" not in functions:
        return []
    f = functions[functions["kind"] == "collective"]
    f = f[f["name"].astype(str).str.startswith(TRANSFER_PREFIX) & (f["nbytes"] > 0) & (f["count"] > 0)]
    if f.empty:
        return []
    f = pd.DataFrame(
        {
            "rank": f["rank"].astype(np.int64),
            "window": f["window"],
            "name": f["name"].astype(str),
            "t": _per_call_us(f) / f["nbytes"].astype(float),
            "nbytes": f["nbytes"].astype(float),
        }
    )
    groups = f.groupby(["window", "name"])["t"]
    med = groups.transform("median")
    n = groups.transform("size")
    mad = (f["t"] - med).abs().groupby([f["window"], f["name"]]).transform("median") * 1.4826
    scale = np.maximum(np.maximum(mad, s.mad_floor * med), 1e-30)
    ratio = f["t"] / med
    slow = (ratio >= s.min_ratio) & (n >= 3) & ((f["t"] - med) * f["nbytes"] >= s.min_excess_us)
    slow &= ((f["t"] - med) / scale >= s.min_z) | (n < s.z_min_ranks)
    f = f.assign(ratio=ratio, slow=slow, peer_t=med)
    suspects = f.loc[f["slow"], ["rank", "name"]].drop_duplicates()
    if suspects.empty:
        return []
    f = f.merge(suspects, on=["rank", "name"])
    per = f.groupby(["rank", "name"]).agg(
        flagged=("slow", "sum"),
        windows=("slow", "size"),
        ratio=("ratio", "median"),
        t=("t", "median"),
        peer_t=("peer_t", "median"),
    )
    out = []
    for (rank, name), r in per.iterrows():
        windows = int(r["windows"])
        need = max(2, int(np.ceil(s.persistence * windows))) if windows > 1 else 1
        if int(r["flagged"]) < need:
            continue
        out.append(
            SlowLink(
                rank=int(rank),
                pattern=str(name),
                ratio=float(r["ratio"]),
                gbps=1e-3 / max(float(r["t"]), 1e-12),
                peer_gbps=1e-3 / max(float(r["peer_t"]), 1e-12),
                windows_flagged=int(r["flagged"]),
                windows=windows,
            )
        )
    return out
