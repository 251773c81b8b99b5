"""Where a job's wall time goes, per rank: compute, communication it waited for, data, the rest.

From the always-on step rows, every step splits into the time its batch took to arrive
(``data_us``), the time the training thread waited inside collectives (``comm_us``: communication
that compute did not hide) and its own time. The profiling windows split that own time further:
each window says what fraction of it the training thread spent running operators (on a GPU: what
fraction the GPU ran kernels or copies), ``busy["compute"]``; the rest of the own time is host
overhead — Python, the optimizer's bookkeeping, launches — and idling. Without a window, the own
time stays one figure (``compute`` is None).

``device_hours``: the job's wall time on all its ranks; ``idle_device_hours``: the part of it not
computing, the figure a fleet list ranks jobs by. Where the hook could read NVML (``pynvml`` and a
GPU), each rank also gets its GPU's mean utilization and its memory in use from the heartbeats.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import pandas as pd

from rankscope.wire.errors import NotFoundError

from .diagnose import window_shares
from .grid import width
from .robust import dense_index

PARTS = ("compute", "comm_wait", "data_wait", "overhead")


@dataclass(frozen=True, slots=True, kw_only=True)
class RankEfficiency:
    rank: int
    host: str
    step_ms: float
    """Mean step time."""
    own: float
    """Fraction of the step time outside collectives and data waits."""
    comm_wait: float
    data_wait: float
    compute: float | None
    """Fraction computing (None: no profiling window to tell)."""
    overhead: float | None
    """Host overhead and idling: ``own - compute``."""
    windows: int
    gpu_util: float | None = None
    """NVML's mean utilization of the rank's GPU over its heartbeats, percent (None: not sampled)."""
    gpu_mem_mb: float | None = None
    window_cost: float | None = None
    """What the rank's profiling windows cost it, as a share of its run time (None: not said)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Efficiency:
    job: str
    device: str
    ranks: list[RankEfficiency]
    shares: dict[str, float | None]
    """The job's split of its wall time (``PARTS``; means over ranks)."""
    wall_s: float
    device_hours: float
    idle_device_hours: float | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def per_rank(steps: pd.DataFrame) -> pd.DataFrame:
    """Per rank (the index): ``n`` steps, the sums ``dur, data, comm`` and ``first, end`` (us; NaN
    without ``start_us``, and a missing ``data_us`` or ``comm_us`` counts 0). In numpy: a pandas
    groupby of a 1,000-rank job's 6 million recent steps takes 0.4 s, this 0.1 s. A row of a large
    job's read stands for ``width`` steps (``grid.WIDTH``)."""
    ranks, at = dense_index(steps["rank"].to_numpy(dtype=np.int64))
    n, w = len(ranks), width(steps)

    def total(column: str) -> np.ndarray:
        if column not in steps:
            return np.zeros(n)
        return np.bincount(at, weights=steps[column].to_numpy(dtype=np.float64), minlength=n) * w

    first, end = np.full(n, np.nan), np.full(n, np.nan)
    if "start_us" in steps:
        start = steps["start_us"].to_numpy(dtype=np.float64)
        first[:], end[:] = np.inf, -np.inf
        np.minimum.at(first, at, start)
        np.maximum.at(end, at, start + steps["dur_us"].to_numpy(dtype=np.float64) * w)
    return pd.DataFrame(
        {
            "n": np.bincount(at, minlength=n) * w,
            "dur": total("dur_us"),
            "data": total("data_us"),
            "comm": total("comm_us"),
            "first": first,
            "end": end,
        },
        index=pd.Index(ranks, name="rank"),
    )


def measure(
    job: str,
    steps: pd.DataFrame,
    windows: pd.DataFrame,
    ranks: pd.DataFrame,
    gpu: pd.DataFrame | None = None,
    costs: pd.DataFrame | None = None,
) -> Efficiency:
    """The split of ``job``'s time from its ``steps`` (``rank, start_us, dur_us, data_us, comm_us``),
    ``windows`` (``rank, busy``), ``ranks`` (``rank, host, device``), ``gpu`` (``rank, gpu_util,
    gpu_mem_mb``: NVML's samples, where the heartbeats carried them) and ``costs`` (``rank, time_us,
    window_cost_us``: what the rank's windows cost by its last heartbeat, ``diagnose.window_shares``)."""
    if steps.empty:
        raise NotFoundError(f"job {job!r} has no steps: nothing to measure")
    per = per_rank(steps)
    compute_share: dict[int, float] = {}
    n_windows: dict[int, int] = {}
    fractions: dict[int, list[float]] = {}
    for rank, busy in zip(windows["rank"], windows["busy"], strict=True) if not windows.empty else ():
        b = dict(busy)
        own = 1.0 - b.get("comm", 0.0) - b.get("data", 0.0)
        if own > 0.05:
            fractions.setdefault(int(rank), []).append(min(1.0, b.get("compute", 0.0) / own))
    for rank, f in fractions.items():
        compute_share[rank], n_windows[rank] = float(np.mean(f)), len(f)
    hosts = (
        dict(zip(ranks["rank"].astype(int), ranks["host"].astype(str), strict=False))
        if not ranks.empty
        else {}
    )
    nvml = {int(g["rank"]): g for _, g in gpu.iterrows()} if gpu is not None and not gpu.empty else {}
    cost = window_shares(ranks, costs) if costs is not None else {}
    out = []
    for rank, r in zip(per.index, per.to_dict("records"), strict=True):
        dur = max(float(r["dur"]), 1.0)
        data, comm = float(r["data"]) / dur, float(r["comm"]) / dur
        own = max(0.0, 1.0 - data - comm)
        share = compute_share.get(int(rank))
        out.append(
            RankEfficiency(
                rank=int(rank),
                host=hosts.get(int(rank), ""),
                step_ms=round(dur / r["n"] / 1e3, 3),
                own=round(own, 4),
                comm_wait=round(comm, 4),
                data_wait=round(data, 4),
                compute=round(own * share, 4) if share is not None else None,
                overhead=round(own * (1 - share), 4) if share is not None else None,
                windows=n_windows.get(int(rank), 0),
                gpu_util=round(float(nvml[int(rank)]["gpu_util"]), 1) if int(rank) in nvml else None,
                gpu_mem_mb=round(float(nvml[int(rank)]["gpu_mem_mb"]), 1) if int(rank) in nvml else None,
                window_cost=round(cost[int(rank)], 5) if int(rank) in cost else None,
            )
        )
    known = [r for r in out if r.compute is not None]
    shares: dict[str, float | None] = {
        "comm_wait": round(float(np.mean([r.comm_wait for r in out])), 4),
        "data_wait": round(float(np.mean([r.data_wait for r in out])), 4),
        "compute": round(float(np.mean([r.compute for r in known])), 4) if known else None,  # type: ignore[misc]
        "overhead": round(float(np.mean([r.overhead for r in known])), 4) if known else None,  # type: ignore[misc]
    }
    wall_s = float(per["end"].max() - per["first"].min()) / 1e6
    device_hours = wall_s * len(out) / 3600
    notes = []
    if not known:
        notes.append("no profiling window yet: compute and host overhead are not told apart")
    elif len(known) < len(out):
        notes.append(f"{len(out) - len(known)} of {len(out)} ranks have no profiling window")
    device = str(ranks["device"].iloc[0]) if not ranks.empty and "device" in ranks else "cpu"
    if device == "cpu":
        notes.append("CPU job: compute is operators on the training thread, not a GPU's kernels")
    return Efficiency(
        job=job,
        device=device,
        ranks=out,
        shares=shares,
        wall_s=round(wall_s, 3),
        device_hours=round(device_hours, 4),
        idle_device_hours=round(device_hours * (1 - shares["compute"]), 4)
        if shares["compute"] is not None
        else None,
        notes=notes,
    )


class EfficiencyReader(Protocol):
    """What :func:`read` needs of a store (``aggregator.Store`` has it)."""

    def steps(self, job: str, since_step: int | None = None, since_us: int | None = None) -> pd.DataFrame: ...
    def windows(self, job: str, since_us: int | None = None) -> pd.DataFrame: ...
    def ranks(self, job: str) -> pd.DataFrame: ...
    def gpu_usage(self, job: str, since_us: int | None = None) -> pd.DataFrame: ...
    def window_costs(self, job: str) -> pd.DataFrame: ...


def read(
    store: EfficiencyReader, job: str, since_us: int | None = None, steps: pd.DataFrame | None = None
) -> Efficiency | None:
    """:func:`measure` of ``job``'s records in ``store`` (from ``since_us`` on, if given; its
    ``steps`` from then on if the caller holds them already); None before its first step."""
    if steps is None:
        steps = store.steps(job, since_us=since_us)
    if steps.empty:
        return None
    windows = store.windows(job, since_us=since_us)
    gpu = store.gpu_usage(job, since_us=since_us)
    return measure(job, steps, windows, store.ranks(job), gpu, store.window_costs(job))
