"""Which nodes fail, from every node's measurements: pure, no torch.

Each node measured its own compute (matmul GFLOP/s) and memory bandwidth, and the bandwidth of
the link it sends on in a ring (node ``i`` to ``i + 1``, all at once). A node fails a check when
it reaches less than ``min_ratio`` of the nodes' median — or of ``baseline``, the fleet's values
from an earlier preflight, where given. A slow link slows the node at each end; a node whose links
in and out are both slow holds the slow NIC (or cable, or port), a slow link with a fast
neighbour on each side is named as that link.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    node: str
    rank: int
    check: str
    """``gpu``, ``compute``, ``memory``, ``network`` or ``link``."""
    value: float
    reference: float
    """What it was held to: the nodes' median or the baseline (0 for a device error)."""
    unit: str
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    nodes: list[dict[str, Any]]
    """Every node's measurements, by rank."""
    failed: list[Check]
    allreduce_busbw_gbps: float
    """The all-reduce bus bandwidth of the job's nodes (nccl-tests' definition)."""
    min_ratio: float
    notes: list[str] = field(default_factory=list)

    @property
    def failed_ranks(self) -> set[int]:
        return {c.rank for c in self.failed}

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "failed_ranks": sorted(self.failed_ranks)}


_UNITS = {"compute": "GFLOP/s", "memory": "GB/s", "network": "GB/s"}
_FIELDS = {"compute": "matmul_gflops", "memory": "memory_gbps", "network": "send_gbps"}


def judge(
    nodes: list[dict[str, Any]],
    allreduce_busbw_gbps: float,
    *,
    min_ratio: float = 0.7,
    baseline: dict[str, float] | None = None,
) -> Report:
    """``nodes``: per rank (in rank order) ``node, matmul_gflops, memory_gbps, send_gbps`` (its
    send to the next rank) and ``gpu_errors`` (messages; empty when none)."""
    failed: list[Check] = []
    notes: list[str] = []
    n = len(nodes)
    for nd in nodes:
        for msg in nd.get("gpu_errors", []):
            failed.append(
                Check(
                    node=nd["node"], rank=nd["rank"], check="gpu", value=0, reference=0, unit="", message=msg
                )
            )
    for check in ("compute", "memory"):
        key = _FIELDS[check]
        ref = (baseline or {}).get(key) or statistics.median(nd[key] for nd in nodes)
        for nd in nodes:
            if nd[key] < min_ratio * ref:
                failed.append(_slow(nd, check, nd[key], ref))
    if n >= 3:
        ref = (baseline or {}).get("send_gbps") or statistics.median(nd["send_gbps"] for nd in nodes)
        slow = [nd["send_gbps"] < min_ratio * ref for nd in nodes]  # link i -> i+1
        for i, nd in enumerate(nodes):
            into, out = slow[i - 1], slow[i]  # the link from the previous node, the link to the next
            if into and out:
                rate = min(nodes[i - 1]["send_gbps"], nd["send_gbps"])
                failed.append(
                    _slow(
                        nd, "network", rate, ref, "its links in and out are both slow: its NIC, cable or port"
                    )
                )
        for i, nd in enumerate(nodes):
            nxt = nodes[(i + 1) % n]
            if slow[i] and not slow[i - 1] and not slow[(i + 1) % n]:
                failed.append(
                    Check(
                        node=f"{nd['node']}->{nxt['node']}",
                        rank=nd["rank"],
                        check="link",
                        value=nd["send_gbps"],
                        reference=ref,
                        unit="GB/s",
                        message=f"the link {nd['node']} -> {nxt['node']} alone reaches {nd['send_gbps'] / ref:.2f}x",
                    )
                )
    else:
        notes.append(f"{n} node(s): a slow link cannot be told from a slow node below 3, not checked")
    return Report(
        nodes=nodes,
        failed=failed,
        allreduce_busbw_gbps=allreduce_busbw_gbps,
        min_ratio=min_ratio,
        notes=notes,
    )


def _slow(nd: dict[str, Any], check: str, value: float, ref: float, why: str = "") -> Check:
    unit = _UNITS[check]
    return Check(
        node=nd["node"],
        rank=nd["rank"],
        check=check,
        value=round(value, 4),
        reference=round(ref, 4),
        unit=unit,
        message=f"{check} {value:.3g} {unit} is {value / ref:.2f}x the reference {ref:.3g}"
        + (f": {why}" if why else ""),
    )


def host_verdicts(reports: Iterable[dict[str, Any]]) -> dict[str, str]:
    """Per node, what its preflight said in ``reports`` (``Report.to_dict``, as ``rankscope
    preflight --out`` writes them; a later report's word on a node replaces an earlier's):
    ``passed``, or ``failed:`` and the failed checks' messages. A link's failure is both its
    nodes'."""
    out: dict[str, str] = {}
    for report in reports:
        failed: dict[str, list[str]] = {}
        for c in report.get("failed", []):
            for node in str(c["node"]).split("->"):
                failed.setdefault(node, []).append(f"{c['check']}: {c['message']}")
        for nd in report.get("nodes", []):
            node = str(nd["node"])
            out[node] = f"failed: {'; '.join(failed[node])}" if node in failed else "passed"
    return out
