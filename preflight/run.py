"""One node's preflight: measure, gather every node's results, judge them (see the package doc)."""

from __future__ import annotations

import os
import socket
import statistics
from typing import Any

from .verdict import Report, judge


def node_name() -> str:
    """``$RANKSCOPE_HOST`` (as the hook names hosts), ``$NODE_NAME`` (Kubernetes' downward API
    ``spec.nodeName``), or the host name."""
    return os.environ.get("RANKSCOPE_HOST") or os.environ.get("NODE_NAME") or socket.gethostname()


def baseline_of(report: dict[str, Any]) -> dict[str, float]:
    """The medians of an earlier preflight's report (``rankscope preflight --out``): the fleet's values."""
    nodes = report.get("nodes", [])
    keys = ("matmul_gflops", "memory_gbps", "send_gbps")
    return {
        k: statistics.median(float(n[k]) for n in nodes) for k in keys if nodes and all(k in n for n in nodes)
    }


ROUNDS = 2
"""The local probes run this many times (in turns, where nodes share a machine), and each node keeps
its best: a neighbour's burst of work that slows one turn does not fail the node. (A CI run's node0
measured 0.57x the others' GFLOP/s in its one turn, with its memory bandwidth normal in the same
turn: a core taken from its two-thread matmul for half a second.)"""


def run(
    *, min_ratio: float = 0.7, baseline: dict[str, float] | None = None, serial: bool = False
) -> tuple[Report, int]:
    """Join the job's process group (``env://``), measure, and judge every node; (report, my rank).
    ``serial``: nodes that share a machine (a test, a demo) take turns on the local probes and
    measure one link at a time."""
    import torch
    import torch.distributed as dist

    from . import probes

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        mine: dict[str, Any] = {"rank": rank, "node": node_name(), **probes.devices()}
        if serial:  # the first turn too runs with every other node idle, not still starting up
            dist.barrier()
        for _ in range(ROUNDS):
            for turn in range(world if serial else 1):
                if not serial or turn == rank:
                    for key, probe in (
                        ("matmul_gflops", probes.matmul_gflops),
                        ("memory_gbps", probes.memory_gbps),
                    ):
                        mine[key] = max(mine.get(key, 0.0), round(probe(), 3))
                if serial:
                    dist.barrier()
        busbw = probes.allreduce_busbw_gbps() if world > 1 else 0.0
        mine["send_gbps"] = round(probes.ring_send_gbps(serial=serial), 4) if world > 1 else 0.0
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
    finally:
        dist.destroy_process_group()
    return judge(everyone, round(busbw, 4), min_ratio=min_ratio, baseline=baseline), rank
