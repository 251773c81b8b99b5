"""``rankscope serve`` at scale: one cycle and the API's latency on a 1,000-rank job.

    python -m benchmarks.scale.serve [--ranks 1000] [--minutes 10] [--cycles 5] [--requests 40] [--json PATH]

Fills an embedded store with a synthetic job's records, as ``--ranks`` hooks at their defaults
would ship them over ``--minutes``: a ``rank`` record each, step blocks of ~2 s (100 ms steps),
a heartbeat every 5 s, a profiling window every 30 s with 40 functions. One rank's device is 1.5x
slower for the last half, so the diagnosis has a straggler to find (rank ``--ranks // 3``). Then a :class:`api.Service`
on that store runs ``--cycles`` cycles, each after 5 s more of every rank's records were written
(what a running job adds between two cycles); halfway, the job's page is opened, so the later
cycles also draw what the page and the API show. Then the FastAPI app answers ``--requests``
requests per route, in process (``TestClient``: no network). The target is a cycle ≤ 2 s and an
API p99 ≤ 200 ms; the table prints the medians, maxima and p99s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from rankscope.aggregator import Store
from rankscope.api import ServeSettings, Service, create_app
from rankscope.wire.records import (
    FunctionPattern,
    Heartbeat,
    RankInfo,
    Record,
    StepBatch,
    StepRow,
    WindowSummary,
)

STEP_US = 100_000
BLOCK = 20  # steps per row: 2 s


def _records(job: str, ranks: int, t0: int, s0: int, steps: int, slow_from: int) -> list[Record]:
    """Every rank's records for steps ``s0 .. s0 + steps`` (job time ``t0`` at step 0)."""
    return [rec for r in range(ranks) for rec in rank_records(job, r, ranks, t0, s0, steps, slow_from)]


def rank_records(
    job: str,
    r: int,
    ranks: int,
    t0: int,
    s0: int,
    steps: int,
    slow_from: int,
    functions: int = 40,
    batch_rows: int = 0,
) -> list[Record]:
    """Rank ``r``'s records for steps ``s0 .. s0 + steps``: its step rows (a row a 2 s block, in
    records of ``batch_rows`` rows; 0: one record), a heartbeat every 5 s and a window every 30 s of
    ``functions`` patterns (the run-queue wait of its threads, as a hook on Linux ships it, and
    operators). Rank ``ranks // 3`` works 1.5x as long per step from step ``slow_from`` on, in its
    three largest operators."""
    out: list[Record] = []
    host = f"node{r // 8}"
    rows = []
    for b in range(s0, s0 + steps, BLOCK):
        n = min(BLOCK, s0 + steps - b)  # a hook's blocks never overlap
        slow = r == ranks // 3 and b >= slow_from
        own = 60_000 * (1.5 if slow else 1.0)
        comm = STEP_US - own if not slow else 10_000
        rows.append(
            StepRow(
                b,
                t0 + b * STEP_US,
                n * STEP_US - (b * 7919 + r) % 997,  # a measured block: not a multiple of n
                n * 2_000,
                int(n * comm),
                n,
                int(own),
                int(n * own * 0.95),
                n,
                n,
            )
        )
    per = batch_rows or len(rows)
    for i in range(0, len(rows), per):
        last = rows[min(i + per, len(rows)) - 1]
        sent = t0 + (last.step + last.n_steps) * STEP_US
        out.append(StepBatch(job=job, rank=r, host=host, time_us=sent, rows=tuple(rows[i : i + per])))
    for s in range(s0, s0 + steps, 50):  # a heartbeat every 5 s
        out.append(
            Heartbeat(job=job, rank=r, host=host, time_us=t0 + s * STEP_US, step=s, progress_age_s=0.05)
        )
    for w in range(s0 - s0 % 300 + (300 if s0 % 300 else 0), s0 + steps, 300):  # a window every 30 s
        slow = r == ranks // 3 and w >= slow_from
        ops = (
            FunctionPattern(
                "op",
                f"aten::op{i}",
                "",
                5,
                1000.0 * (functions - i) * (1.5 if slow and i < 3 else 1.0),
                200.0,
                190.0,
                250.0,
                300.0,
                0.1,
                20_000.0,
                0.05,
                0,
            )
            for i in range(functions - 1)
        )
        fns = (*ops, _cpu_wait(r))
        out.append(
            WindowSummary(
                job=job,
                rank=r,
                host=host,
                time_us=t0 + (w + 5) * STEP_US,
                window=w,
                step_lo=w,
                step_hi=w + 5,
                dur_us=5 * STEP_US,
                busy={"compute": 0.6, "comm": 0.3, "data": 0.02},
                n_events=4000,
                functions=fns,
            )
        )
    return out


def _cpu_wait(r: int) -> FunctionPattern:
    """A window's run-queue wait of the rank's threads, ~1 ms per step (``profiler_hook.schedstat``)."""
    total = 5_000.0 + (r * 37) % 500
    return FunctionPattern(
        "sched",
        "cpu_wait@sched",
        "",
        40,
        total,
        total / 40,
        total / 40,
        total / 40,
        total / 40,
        0.0,
        0.0,
        0.0,
        0,
    )


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=1000)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--cycles", type=int, default=5)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    job, steps = "scale", int(a.minutes * 60e6 / STEP_US)
    t0 = time.time_ns() // 1000 - steps * STEP_US - a.cycles * 5_000_000
    with tempfile.TemporaryDirectory() as tmp, Store.embedded(Path(tmp) / "store") as store:
        w0 = time.perf_counter()
        store.write(
            [
                RankInfo(
                    job=job,
                    rank=r,
                    host=f"node{r // 8}",
                    time_us=t0,
                    local_rank=r % 8,
                    world_size=a.ranks,
                    pid=1000 + r,
                )
                for r in range(a.ranks)
            ]
        )
        for s0 in range(0, steps, 600):  # a minute at a time
            store.write(_records(job, a.ranks, t0, s0, min(600, steps - s0), steps // 2))
        fill_s = time.perf_counter() - w0
        svc = Service(store, ServeSettings())
        client = TestClient(create_app(svc))
        cycles, views = [], []
        watched_from = a.cycles // 2 + 1
        for c in range(a.cycles + 1):
            if c == watched_from:  # someone opens the job's page: from now on each cycle draws its pictures
                client.get(f"/jobs/{job}")
            if c:  # 5 s more of every rank's records, as a running job sends between two cycles
                store.write(_records(job, a.ranks, t0, steps + (c - 1) * 50, 50, steps // 2))
            now = t0 + (steps + c * 50) * STEP_US
            t = time.perf_counter()
            svc.cycle(now_us=now)
            cycles.append(time.perf_counter() - t)
            views.append(svc.stats.last_views_s)
        problem = svc.stats.cycle_problem
        findings = (svc.jobs[job].diagnosis or {}).get("findings", [])
        routes = ["/api/v1/jobs", f"/api/v1/jobs/{job}", f"/api/v1/jobs/{job}/diagnosis"]
        routes += [f"/api/v1/jobs/{job}/{part}" for part in ("heatmap", "steps", "efficiency", "reliability")]
        routes += [f"/jobs/{job}"]
        latency: dict[str, list[float]] = {}
        for route in routes:
            for _ in range(a.requests):
                t = time.perf_counter()
                status = client.get(route).status_code
                latency.setdefault(route, []).append(time.perf_counter() - t)
                assert status == 200, (route, status)
    out = {
        "ranks": a.ranks,
        "minutes": a.minutes,
        "fill_s": round(fill_s, 1),
        "first_cycle_s": round(cycles[0], 3),
        "cycle_median_s": round(statistics.median(cycles[1:watched_from]), 3),
        "cycle_max_s": round(max(cycles[1:watched_from]), 3),
        "watched_cycle_median_s": round(statistics.median(cycles[watched_from:]), 3),
        "views_median_s": round(statistics.median(views[watched_from:]), 3),
        "cycle_problem": problem,
        "top_finding": f"{findings[0]['cause']} @ ranks {findings[0]['ranks']}" if findings else "",
        "api_ms": {
            r: {"p50": round(1e3 * _pct(v, 0.5), 1), "p99": round(1e3 * _pct(v, 0.99), 1)}
            for r, v in latency.items()
        },
    }
    print(
        f"{a.ranks} ranks, {a.minutes:g} min of records (filled in {out['fill_s']} s); top finding: {out['top_finding']}"
    )
    print(
        f"cycle: first {out['first_cycle_s']} s, then median {out['cycle_median_s']} s, max {out['cycle_max_s']} s;"
        f" with the job's page open median {out['watched_cycle_median_s']} s (of which drawing what the API"
        f" and the page show: {out['views_median_s']} s)"
    )
    print("| route | p50 ms | p99 ms |\n|---|---|---|")
    for r, v in out["api_ms"].items():
        print(f"| `{r}` | {v['p50']} | {v['p99']} |")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
