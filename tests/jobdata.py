"""Hand-built ``JobData`` for the diagnosis's tests: a synchronous job's step rows with faults put
in, and profiling windows' rows."""

from __future__ import annotations

import numpy as np
import pandas as pd

from rankscope.diagnosis import Finding, JobData
from rankscope.diagnosis.data import STEP_FIELDS


def synthetic(
    ranks: int = 8,
    steps: int = 300,
    *,
    slow: dict[int, dict[str, float]] | None = None,
    hosts_of: int = 4,
    seed: int = 0,
    growth: float = 1.0,
    bias: dict[int, float] | None = None,
) -> JobData:
    """A synchronous job: each step every rank does its own work, then all wait for the slowest.

    ``slow[rank]`` adds to that rank's ``compute_us``, ``data_us``, ``nivcsw`` or scales ``cpu``;
    with ``on`` and ``off`` (steps), only in bursts: ``on`` steps slow, then ``off`` steps not;
    with ``from``, from that step on. ``growth`` makes every rank's work grow linearly to that
    factor by the last step (job-wide). ``bias[rank]`` scales a rank's compute throughout (its
    steady offset: its cores, its NUMA node).
    """
    rng = np.random.default_rng(seed)
    slow = slow or {}
    rows = []
    for s in range(steps):
        scale = 1 + (growth - 1) * s / steps
        base = 5000 * scale * rng.lognormal(0, 0.05)  # machine-wide noise, the same for all ranks
        work = {}
        for r in range(ranks):
            extra = slow.get(r, {})
            if "on" in extra and s % (extra["on"] + extra["off"]) >= extra["on"]:
                extra = {}
            if s < extra.get("from", 0):
                extra = {}
            data = 300 * rng.lognormal(0, 0.1) + extra.get("data_us", 0)
            compute = base * (bias or {}).get(r, 1.0) * rng.lognormal(0, 0.04) + extra.get("compute_us", 0)
            work[r] = (data, compute, extra)
        end = max(d + c for d, c, _ in work.values()) + 100
        for r, (data, compute, extra) in work.items():
            own = data + compute
            rows.append(
                {
                    "rank": r,
                    "step": s,
                    "dur_us": end + 50,
                    "data_us": data,
                    "comm_us": end - own,
                    "n_coll": 1,
                    "first_coll_us": own,
                    "cpu_us": compute * extra.get("cpu", 0.98),
                    "nivcsw": 2 + extra.get("nivcsw", 0),
                    "wait_us": extra.get("wait", 0),
                    "gc_us": extra.get("gc_us", 0),
                }
            )
    per_host = max(1, ranks // hosts_of)
    return JobData(
        job="synthetic",
        ranks=pd.DataFrame(
            {
                "rank": range(ranks),
                "host": [f"node{r // per_host}" for r in range(ranks)],
                "nic": "",
                "switch": "",
            }
        ),
        steps=pd.DataFrame(rows)[STEP_FIELDS],
    )


def functions_frame(per_rank: dict[int, list[tuple]]) -> pd.DataFrame:
    """Window rows: (kind, name, count, total_us[, stack]) per rank, one window of 5 steps."""
    rows = [
        {
            "rank": r,
            "window": 0,
            "step_lo": 100,
            "step_hi": 105,
            "kind": k,
            "name": n,
            "stack": stack[0] if stack else "",
            "count": c,
            "total_us": t,
            "mean_us": t / c,
            "p50_us": t / c,
            "max_us": t / c,
        }
        for r, fs in per_rank.items()
        for k, n, c, t, *stack in fs
    ]
    return pd.DataFrame(rows)


def only(findings: list[Finding]) -> Finding:
    assert len(findings) == 1, [f.summary for f in findings]
    return findings[0]


def sched_windows(
    wait_ms: dict[int, float], base_ms: float = 1.0, ranks: int = 8, windows: int = 4
) -> pd.DataFrame:
    """``cpu_wait@sched`` window rows: ~``base_ms`` of CPU wait per step, or ``wait_ms[rank]``."""
    return pd.DataFrame(
        [
            {
                "rank": r,
                "window": w,
                "step_lo": 50 + 50 * w,
                "step_hi": 60 + 50 * w,
                "kind": "sched",
                "name": "cpu_wait@sched",
                "stack": "",
                "count": 12,
                "total_us": 10 * 1000 * wait_ms.get(r, base_ms * (1.0 + 0.02 * r)),
                "mean_us": 0.0,
                "p50_us": 0.0,
                "max_us": 0.0,
            }
            for w in range(windows)
            for r in range(ranks)
        ]
    )


LINK_T0 = 1_795_000_000_000_000
"""When the ring's heartbeats start (µs since the epoch)."""


def ring_links(hosts: int, slow_ms_per_mb: dict[tuple[int, int], float], spans: int = 6) -> pd.DataFrame:
    """Heartbeats' link sends of a ring over ``hosts`` hosts (one rank each, address 10.0.0.<rank>):
    every 5 s each rank has sent 40 MB to the next, 1 ms per MB, or ``slow_ms_per_mb[(src, dst)]``;
    and, as gloo's ranks do, 0.1 MB of small messages to the one before, 3 s per MB (their latency)."""
    rows = []
    for span in range(spans):
        for r in range(hosts):
            nxt, prev = (r + 1) % hosts, (r - 1) % hosts
            ms = slow_ms_per_mb.get((r, nxt), 1.0 + 0.03 * ((r + span) % 3))
            t = LINK_T0 + (span + 1) * 5_000_000 + r * 1_000
            rows += [
                {"rank": r, "time_us": t, "link": f"10.0.0.{r}>10.0.0.{nxt}", "nbytes": 40 << 20, "send_us": int(40 * ms * 1000)},
                {"rank": r, "time_us": t, "link": f"10.0.0.{r}>10.0.0.{prev}", "nbytes": 100 << 10, "send_us": 300_000},
            ]  # fmt: skip
    return pd.DataFrame(rows)


def samples_frame(per_rank: dict[int, dict[str, int]]) -> pd.DataFrame:
    """The heartbeats' stack samples as ``JobData.samples`` holds them: per rank, a count per key
    (``wire.records.sample_key``)."""
    rows = [(r, key, n) for r, keys in per_rank.items() for key, n in keys.items()]
    return pd.DataFrame(rows, columns=["rank", "function", "samples"])
