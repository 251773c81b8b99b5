"""What the collective tracking costs the training thread per call, lean and in full.

    python -m benchmarks.overhead.calls [--rounds 30] [--iters 1000] [--json PATH]

Two gloo ranks on this machine's cores. An iteration is what a pipeline stage does with its
neighbour, then with its data-parallel peer: an ``isend``/``irecv`` pair through
``batch_isend_irecv`` and both works' ``wait()`` (as ``torch.distributed.pipelining``'s schedules
issue them), then a blocking ``all_gather_single`` (as FSDP2 issues its all-gathers on gloo), with
a 1 MB copy between iterations so that the calls run from cold caches as inside a training step.
Per block of ``--iters`` iterations, the training thread's CPU time; blocks rotate through three
modes, round after round: ``off`` (nothing patched), ``lean`` (the tracker patched, a lean step:
calls noted, counted at the step's end) and ``full`` (patched, every call recorded in full, as at a
step that reads the run-queue wait; the reads themselves left out). Per mode, the median block's
µs per iteration, and its difference from ``off`` in the same round (median, quartiles).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from benchmarks.procs import free_port

MODES = ("off", "lean", "full")


def _worker(rank: int, port: int, rounds: int, iters: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from rankscope.profiler_hook.collectives import CollectiveTracker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    peer, t, gathered = 1 - rank, torch.zeros(1024), torch.zeros(2048)
    src, dst = torch.randn(1 << 18), torch.empty(1 << 18)
    tracker = CollectiveTracker()

    def iteration() -> None:
        sends = [dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, t, peer)]
        for work in dist.batch_isend_irecv(sends if rank == 0 else sends[::-1]):
            work.wait()
        dist.all_gather_single(gathered, t)
        dst.copy_(src)

    def block(mode: str) -> float:
        if mode != "off":
            tracker.patch()
        tracker.take_step(time.perf_counter_ns())
        tracker.read_wait = mode == "full"  # a read step takes the full path (its reads: none here)
        dist.barrier()
        cpu = time.thread_time_ns()
        for _ in range(iters):
            iteration()
        cpu = time.thread_time_ns() - cpu
        tracker.take_step(time.perf_counter_ns())
        if mode != "off":
            tracker.unpatch()
        return cpu / iters / 1e3

    for _ in range(20):
        iteration()
    us: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in MODES[r % 3 :] + MODES[: r % 3]:  # each mode first in a third of the rounds
            us[mode].append(block(mode))
    if rank == 0:
        Path(out).write_text(json.dumps(us))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=30, help="blocks of each mode (default 30)")
    p.add_argument("--iters", type=int, default=1000, help="iterations a block (default 1000)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    if a.rounds < 2 or a.iters < 1:
        raise SystemExit(f"--rounds must be >= 2 and --iters >= 1, got {a.rounds} and {a.iters}")
    out = Path(os.environ.get("TMPDIR", "/tmp"), f"calls-{os.getpid()}.json")
    t0 = time.perf_counter()
    mp.start_processes(
        _worker, args=(free_port(), a.rounds, a.iters, str(out)), nprocs=2, start_method="spawn"
    )
    us = json.loads(out.read_text())
    out.unlink()
    rows = []
    for mode in MODES:
        extra = [on - off for on, off in zip(us[mode], us["off"], strict=True)]
        rows.append({
            "mode": mode,
            "cpu_us_per_iteration": round(statistics.median(us[mode]), 1),
            "over_off_us": round(statistics.median(extra), 1) if mode != "off" else 0.0,
            "over_off_quartiles_us": [round(q, 1) for q in statistics.quantiles(extra, n=4)] if mode != "off" else [],
        })  # fmt: skip
    print("| mode | CPU µs an iteration (median block) | over off (median pair) | quartiles |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['cpu_us_per_iteration']} | {r['over_off_us']:+} | {r['over_off_quartiles_us']} |"
        )
    result = {"benchmark": "tracking_calls", "rounds": a.rounds, "iters": a.iters, "rows": rows, "us": us,
              "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
