"""``link`` (cause ``communication``): a slow network link — the rank whose sends take longer per
byte than its peers', without the wait for peers (the rule is ``diagnosis.communication``)."""

from __future__ import annotations

from ..communication import CommunicationSettings as Settings
from ..communication import SlowLink
from ..communication import find as slow_links
from ..data import JobData
from ..findings import Finding, effect

__all__ = ["Settings", "find"]


def find(data: JobData, s: Settings) -> list[Finding]:
    """One finding per rank whose link is slow."""
    links = slow_links(data.functions, s, data.ranks, data.links)
    hosts = data.hosts_of(link.rank for link in links)
    return [_finding(link, hosts) for link in links]


def _finding(link: SlowLink, hosts: dict[int, str]) -> Finding:
    host = hosts.get(link.rank, "")
    held = (
        {"spans_flagged": f"{link.windows_flagged}/{link.windows}", "span_s": round(link.span_s, 1)}
        if link.span_s
        else {"windows_flagged": f"{link.windows_flagged}/{link.windows}"}
    )
    return Finding(
        cause="communication",
        ranks=[link.rank],
        hosts=[host] if host else [],
        function=link.pattern,
        confidence=round(effect(link.ratio) * link.windows_flagged / max(link.windows, 1), 3),
        summary=(
            f"rank {link.rank}{f' ({host})' if host else ''}: slow network link — it sends "
            f"{link.gbps:.3g} GB/s in {link.pattern} where its peers send {link.peer_gbps:.3g} GB/s "
            f"({link.ratio:.2f}x the time per byte); every rank's collectives wait for the slowest link"
        ),
        evidence={
            "metric": "network send time per byte, without the wait for peers",
            "rank_gbps": round(link.gbps, 3),
            "peer_median_gbps": round(link.peer_gbps, 3),
            "ratio": round(link.ratio, 3),
            **held,
        },
    )
