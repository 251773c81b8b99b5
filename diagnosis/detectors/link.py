"""``link`` (cause ``communication``): a slow network link.

Which ranks' network link is slow, from per-rank transfer throughput in the profiling windows.

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

Where a measurement names its link's endpoints (``"<local IP>><peer IP>"``: the sends the hook's
heartbeats carry per link, every few seconds; or, in records of older hooks, a window's
``net_send@tcp`` pattern with the pair as its ``stack``), the links are compared instead, per span
of ``CommunicationSettings.span_s`` seconds, and the culprit is found as in network tomography: a
slow NIC slows every link through it, in both directions, and no other. Ranks that merely send
*into* the slow NIC have one slow link among healthy ones. So per window the slow links are found,
and the smallest group of ranks — the ranks behind one address, a NIC, a host, a switch — whose
links to the rest of the job carry most of their extra send time, most of its links being slow,
is the culprit. Where no such group explains a window's slow links but one link does — the link
between two addresses, slow one way or both, each end's other links healthy (a pipeline's stage-
to-stage link, a bad cable or port between two hosts) — that link is the culprit, named by its two
ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from rankscope.wire.records import TRANSFER_PREFIX
from rankscope.wire.settings import check_numbers

from ..data import JobData
from ..findings import LEVELS, Finding, effect
from ..robust import needed, spread


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    min_ratio: float = 1.3
    """A rank's time per byte must exceed the peers' median by this factor..."""
    min_z: float = 5.0
    """...and by this many robust standard deviations (from ``z_min_ranks`` ranks on)."""
    z_min_ranks: int = 8
    """Below this many links (or ranks) in a window the deviation test is left out: their spread
    says too little."""
    mad_floor: float = 0.03
    """The robust deviation is never taken below this fraction of the median."""
    persistence: float = 0.5
    """A culprit must be slow in at least this fraction of the windows that saw it."""
    min_excess_us: float = 20_000.0
    """...and spend at least this much longer sending in the window than the peers' rate implies.
    Kernels count TCP busy time in jiffies (1-10 ms), so on a fast link a few ms are noise."""
    cut_share: float = 0.5
    """Links with endpoints: with more than this share of the ranks a culprit group has links to,
    its links must all be slow, both ways (counted by peer, not by link: a span can miss one
    direction of a pair, whose rank's beat has not come yet; and a link into a slow one backs up,
    at 1.3-1.7x, where the other way is at its peers' speed)..."""
    coverage: float = 0.75
    """...and they must carry at least this share of the window's extra send time over slow links
    (a link behind a slow one can back up and look slow too, a little)."""
    bulk_share: float = 0.1
    """Links with endpoints: only those that sent at least this share of the window's busiest
    link's bytes are compared."""
    one_link_ratio: float = 2.0
    """A link named alone (no group of ranks explains its window; each end at its peers' speed on
    its other links) must take this many times the window's healthy time per byte: a port or cable
    that fails trains down to half its rate or less (100 to 50 or 25 Gb/s), where links' rates
    differ by path and load within that."""
    span_s: float = 5.0
    """The heartbeats' link sends are compared across ranks per span of this many seconds (at least
    the ranks' heartbeat period): each span is a window of the comparison."""

    def __post_init__(self) -> None:
        check_numbers(self)


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
    span_s: float = 0.0
    """The windows are spans of this many seconds of heartbeats (0: profiling windows)."""
    peer: int = -1
    """The rank at the link's other end where the culprit is one link between two ranks (-1: the
    rank's own NIC, host or switch)."""


def _per_call_us(f: pd.DataFrame) -> pd.Series:
    """The time of the pattern's executions: the median call's (a one-step spike moves only the mean)."""
    if "p50_us" in f:
        p50 = f["p50_us"].astype(float) * f["count"]
        return p50.where(p50 > 0, f["total_us"])
    return f["total_us"].astype(float)


def slow_links(
    functions: pd.DataFrame,
    s: Settings | None = None,
    ranks: pd.DataFrame | None = None,
    links: pd.DataFrame | None = None,
    roles: list[list[int]] | None = None,
) -> list[SlowLink]:
    """Ranks whose network send time per byte persistently exceeds their peers'; ``ranks`` (rank,
    nic, host, switch) lets links with endpoints be grouped by topology; ``links`` (rank, time_us,
    link, nbytes, send_us: the heartbeats') are those links' sends, measured all along; ``roles``
    (``JobData.roles``) lets a link be compared with the links between ranks of the same roles."""
    s = s or Settings()
    out: list[SlowLink] = []
    spans = _spans(links, s) if links is not None and (links["nbytes"] > 0).any() else None
    if not functions.empty and "nbytes" in functions:
        f = functions[functions["kind"] == "collective"]
        f = f[f["name"].astype(str).str.startswith(TRANSFER_PREFIX) & (f["nbytes"] > 0) & (f["count"] > 0)]
        pair = (
            f["stack"].astype(str).str.contains(">", regex=False)
            if "stack" in f
            else pd.Series(False, f.index)
        )
        if not pair.all():
            out += _per_rank(f[~pair], s)
        if pair.any() and spans is None:  # an older hook's windows; the heartbeats' spans, if any, say more
            out += _tomography(f[pair], s, ranks, roles=roles)
    if spans is not None:
        out += _tomography(spans[0], s, ranks, span_s=spans[1], roles=roles)
    return out


def _spans(links: pd.DataFrame, s: Settings) -> tuple[pd.DataFrame, float]:
    """The heartbeats' link sends as transfer patterns (``stack`` = the link), one row per link and
    span, and the span's length: ``span_s``, or the ranks' heartbeat period if longer, so that a span
    holds every rank's sends."""
    links = links[links["nbytes"] > 0]
    beats = links[["rank", "time_us"]].drop_duplicates()
    period = beats.groupby("rank")["time_us"].diff().median() / 1e6
    span_s = max(s.span_s, float(period) if period == period else 0.0)  # NaN: one beat per rank
    # Each rank beats at its own phase of the span, up to a poll early or late: cut at fixed times,
    # a span held two beats of a rank whose beats fall near its edges and the one before it none.
    # Each beat goes to the span its rank's phase places it in, the spans cut at the widest gap
    # between the ranks' phases, so that a span holds one beat of every rank, as close as can be.
    span_us = int(span_s * 1e6)
    t = links["time_us"].astype(np.int64)
    phase = _phases(beats, span_us)
    frame = pd.DataFrame(
        {
            "rank": links["rank"].astype(np.int64),
            "window": np.round((t - links["rank"].map(phase).to_numpy()) / span_us).astype(np.int64),
            "name": f"{TRANSFER_PREFIX}tcp",
            "stack": links["link"].astype(str),
            "total_us": links["send_us"].astype(float),
            "nbytes": links["nbytes"].astype(float),
        }
    )
    # A span may still hold two of a rank's beats (one came late): one link, one row, or its slow
    # link counts twice against a NIC's other links. The newest span, where most ranks' beats
    # have not come yet, and the oldest in view say little: spans with under half the ranks' go.
    frame = frame.groupby(["rank", "window", "name", "stack"], as_index=False)[["total_us", "nbytes"]].sum()
    ranks = frame.groupby("window")["rank"].transform("nunique")
    return frame[ranks * 2 >= frame["rank"].nunique()], span_s


def _phases(beats: pd.DataFrame, span_us: int) -> pd.Series:
    """Per rank, the phase of its beats (``rank``, ``time_us``) in a span of ``span_us``: their
    circular mean, taken in ``[cut, cut + span_us)`` with the cut at the middle of the widest gap
    between the ranks' phases."""
    angle = 2 * np.pi * (beats["time_us"].astype(np.int64) % span_us) / span_us
    mean = (
        pd.DataFrame({"rank": beats["rank"], "sin": np.sin(angle), "cos": np.cos(angle)})
        .groupby("rank")
        .mean()
    )
    phase = (np.arctan2(mean["sin"], mean["cos"]) / (2 * np.pi) % 1.0) * span_us
    ordered = np.sort(phase.to_numpy())
    gaps = np.diff(np.append(ordered, ordered[0] + span_us))
    cut = (ordered[int(np.argmax(gaps))] + gaps.max() / 2) % span_us
    return phase.where(phase >= cut, phase + span_us)


def _per_rank(f: pd.DataFrame, s: Settings) -> list[SlowLink]:
    """Each rank's one transfer measurement per window against the other ranks'."""
    f = pd.DataFrame(
        {
            "rank": f["rank"].astype(np.int64),
            "window": f["window"],
            "name": f["name"].astype(str),
            "t": _per_call_us(f) / f["nbytes"].astype(float),
            "nbytes": f["nbytes"].astype(float),
        }
    )
    med, scale, n = spread(f["t"], [f["window"], f["name"]], s.mad_floor, 1e-30)
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
        if int(r["flagged"]) < needed(windows, s.persistence):
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


def _slow_links(f: pd.DataFrame, s: Settings, roles: list[list[int]] | None = None) -> pd.DataFrame:
    """One row per rank, window and link (local > peer address) with its time per byte ``t``, the
    window's healthy time per byte ``base`` and whether the link is ``slow``.

    The healthy baseline is the lower quartile of the window's links, a link's own (not one
    interpolated between two): a slow NIC in a ring slows two links (in and out), up to half of a
    small job's, and the median would move with them; with 4 links an interpolated quartile moves
    with a third link that backs up behind them (behind a 1 Gbit/s NIC: 3.2 ms per MB where a
    healthy link takes 2.0), and leaves the slow ones short of ``min_excess_us``.

    Where the job's ranks have roles (a pipeline's stages), it is that of the links of its kind,
    between ranks of the same roles: a healthy pipeline's stage-to-stage sends, bursts of a few
    megabytes, read 9-16x the time per byte of the data-parallel links beside them (dp x pp on four
    hosts); compared with those, a healthy pipeline link took up to a third of the extra send time
    of the slow link beside it, and the slow link fell short of ``coverage`` in one span of three.

    Links that carried little (under ``bulk_share`` of the window's busiest) are left out, as the
    hook leaves them out of its heartbeats: their time per byte is the latency of a few small
    messages (a delayed ACK holds one 40 ms), not the link's bandwidth, and reads as 500 to 20,000
    times the bulk links'."""
    nbytes = f["nbytes"].astype(float)
    f = f[nbytes >= s.bulk_share * nbytes.groupby(f["window"]).transform("max")]
    local_peer = f["stack"].astype(str).str.split(">", n=1, expand=True)
    d = pd.DataFrame(
        {
            "rank": f["rank"].astype(np.int64),
            "window": f["window"],
            "local": local_peer[0],
            "peer": local_peer[1],
            "t": _per_call_us(f) / f["nbytes"].astype(float),
            "nbytes": f["nbytes"].astype(float),
        }
    )
    base = _lower_quartile(d["t"], d["window"])
    kind = _kinds(d, roles)
    if kind.nunique() > 1:
        # A kind's baseline in the window where it holds two links; else over the spans in view,
        # where it holds two: a span can miss a rank whose beat came late.
        pair = d["rank"].astype(str) + ">" + d["peer"]
        in_window = d.groupby([d["window"], kind])["t"].transform("size")
        base = base.where(pair.groupby(kind).transform("nunique") < 2, _lower_quartile(d["t"], kind))
        base = base.where(in_window < 2, _lower_quartile(d["t"], [d["window"], kind]))
    # The deviation test among the links of its kind, the window's own size for the rest.
    med, scale, alike = spread(d["t"], [d["window"], kind], s.mad_floor, 1e-30)
    n = d.groupby("window")["t"].transform("size")
    slow = (d["t"] >= s.min_ratio * base) & (n >= 3) & ((d["t"] - base) * d["nbytes"] >= s.min_excess_us)
    slow &= ((d["t"] - med) / scale >= s.min_z) | (alike < s.z_min_ranks)
    return d.assign(base=base, slow=slow)


def _lower_quartile(t: pd.Series, by: object) -> pd.Series:
    return t.groupby(by).transform(lambda x: x.quantile(0.25, interpolation="lower"))


def _kinds(d: pd.DataFrame, roles: list[list[int]] | None) -> pd.Series:
    """Each link's kind: the role of the rank that sends on it, and the roles of the ranks behind
    its peer address (those that send from it); one kind where the job has one role."""
    if not roles or len(roles) < 2:
        return pd.Series("", index=d.index)
    role = {r: i for i, group in enumerate(roles) for r in group}
    behind = d.groupby("local")["rank"].agg(
        lambda r: ",".join(str(x) for x in sorted({role.get(int(v), -1) for v in r}))
    )
    return (
        d["rank"].map(role).fillna(-1).astype(np.int64).astype(str) + ">" + d["peer"].map(behind).fillna("?")
    )


def _groups(d: pd.DataFrame, ranks: pd.DataFrame | None, suspects: set[int]) -> list[frozenset[int]]:
    """Candidate culprits holding a suspect rank, smallest first: the ranks behind each address,
    then each NIC, host, switch and spine of the ranks table."""
    behind = d[d["local"].isin(d.loc[d["rank"].isin(suspects), "local"])]
    out = set(behind.groupby("local")["rank"].agg(frozenset))
    if ranks is not None and not ranks.empty:
        r = ranks[ranks["rank"].isin(d["rank"].unique())]
        for level in LEVELS:
            if level in r:
                labeled = r[r[level].astype(str) != ""]
                mine = labeled[labeled[level].isin(labeled.loc[labeled["rank"].isin(suspects), level])]
                out |= set(mine.groupby(level)["rank"].agg(lambda x: frozenset(int(v) for v in x)))
    return sorted(out, key=lambda g: (len(g), sorted(g)))


def _tomography(
    f: pd.DataFrame,
    s: Settings,
    ranks: pd.DataFrame | None,
    span_s: float = 0.0,
    roles: list[list[int]] | None = None,
) -> list[SlowLink]:
    """The smallest groups of ranks whose links to the rest carry the slow links, in most windows."""
    d = _slow_links(f, s, roles)
    if not d["slow"].any():
        return []
    # An address stands for the ranks behind it, which share a host and so every group above it:
    # one of them is enough to place a link's end.
    first = d.groupby("local")["rank"].min()
    src = first.loc[d["local"]].to_numpy()
    dst = d["peer"].map(first).fillna(-1).to_numpy(dtype=np.int64)  # a peer that never sent: outside
    windows = d["window"].to_numpy()
    slow = d["slow"].to_numpy()
    extra = np.where(slow, (d["t"] - d["base"]) * d["nbytes"], 0.0)
    suspects = {int(r) for r in (*src[slow], *dst[slow]) if r >= 0}  # only groups touching a slow link
    flagged: dict[frozenset[int], list[int]] = {}
    seen: dict[frozenset[int], list[int]] = {}
    crossing: dict[frozenset[int], np.ndarray] = {}
    for g in _groups(d, ranks, suspects):
        members = np.fromiter(g, dtype=np.int64)
        sends = np.isin(src, members)
        cross = sends != np.isin(dst, members)
        crossing[g] = cross
        other = np.where(sends, dst, src)  # each crossing link's end outside the group
        # Only spans that hold the group's own sends: the newest, before its beat came, or one it
        # missed a beat in, shows only the links into it, and one slow link into it is no slow NIC.
        for w in np.unique(windows[cross & sends]):
            in_w = windows == w
            seen.setdefault(g, []).append(int(w))
            slow_w, cross_w = slow & in_w, cross & in_w
            if (
                slow_w.any()
                and extra[slow_w & cross_w].sum() >= s.coverage * extra[slow_w].sum()
                and len(ends := set(other[cross_w])) - len(set(other[cross_w & ~slow]))
                > s.cut_share * len(ends)
            ):
                flagged.setdefault(g, []).append(int(w))
    # Per window only the smallest groups that explain it; then persistence since the first.
    smallest: dict[int, int] = {}
    for g, ws in flagged.items():
        for w in ws:
            smallest[w] = min(smallest.get(w, len(g)), len(g))
    pattern = str(f["name"].iloc[0])
    out = _one_link(d, s, src, dst, extra, explained=set(smallest), pattern=pattern, span_s=span_s)
    for g, ws in flagged.items():
        mine = [w for w in ws if len(g) == smallest[w]]
        if not mine:
            continue
        since = [w for w in seen[g] if w >= mine[0]]
        # Two windows at least, even when there is one so far: a job's first window (connections
        # still warming up) can show one rank's links slow.
        if len(mine) < needed(len(since), s.persistence):
            continue
        rows = d[np.isin(windows, mine) & slow & crossing[g]]
        out += [_slow_link(rows, pattern, r, len(mine), len(since), span_s) for r in sorted(g)]
    return out


def _slow_link(
    rows: pd.DataFrame, pattern: str, rank: int, flagged: int, windows: int, span_s: float, peer: int = -1
) -> SlowLink:
    """A culprit from its slow links' rows (``t``, ``base``: time per byte, the healthy links')."""
    t, base = float(rows["t"].median()), float(rows["base"].median())
    return SlowLink(
        rank=rank,
        peer=peer,
        pattern=pattern,
        ratio=t / max(base, 1e-30),
        gbps=1e-3 / max(t, 1e-12),
        peer_gbps=1e-3 / max(base, 1e-12),
        windows_flagged=flagged,
        windows=windows,
        span_s=span_s,
    )


def _one_link(
    d: pd.DataFrame,
    s: Settings,
    src: np.ndarray,
    dst: np.ndarray,
    extra: np.ndarray,
    explained: set[int],
    pattern: str,
    span_s: float,
) -> list[SlowLink]:
    """The links that are culprits on their own: in the windows no group of ranks explains, the
    pair of ends whose links (either way) carry ``coverage`` of the window's extra send time, in
    most windows since the first (of those where the pair carried bulk traffic)."""
    windows, slow = d["window"].to_numpy(), d["slow"].to_numpy()
    ratio = (d["t"] / d["base"]).to_numpy()
    lo, hi = np.minimum(src, dst), np.maximum(src, dst)
    known = dst >= 0
    flagged: dict[tuple[int, int], list[int]] = {}
    for w in np.unique(windows[slow & known]):
        if int(w) in explained:
            continue
        slow_w = slow & (windows == w)
        for a, b in {(int(x), int(y)) for x, y in zip(lo[slow_w & known], hi[slow_w & known], strict=True)}:
            on = slow_w & (lo == a) & (hi == b)
            if (
                extra[on].sum() >= s.coverage * extra[slow_w].sum()
                and np.median(ratio[on]) >= s.one_link_ratio
            ):
                flagged.setdefault((a, b), []).append(int(w))
    out = []
    for (a, b), ws in flagged.items():
        on = known & (lo == a) & (hi == b)
        since = [w for w in np.unique(windows[on]) if w >= ws[0]]
        if len(ws) < needed(len(since), s.persistence):
            continue
        rows = d[on & slow & np.isin(windows, ws)]
        out.append(_slow_link(rows, pattern, a, len(ws), len(since), span_s, peer=b))
    return out


def find(data: JobData, s: Settings) -> list[Finding]:
    """One finding per rank whose link is slow."""
    links = slow_links(data.functions, s, data.ranks, data.links, data.roles())
    hosts = data.hosts_of(r for link in links for r in (link.rank, link.peer) if r >= 0)
    return [_finding(link, hosts) if link.peer < 0 else _link_finding(link, hosts) for link in links]


def _held(link: SlowLink) -> dict[str, object]:
    if link.span_s:
        return {"spans_flagged": f"{link.windows_flagged}/{link.windows}", "span_s": round(link.span_s, 1)}
    return {"windows_flagged": f"{link.windows_flagged}/{link.windows}"}


def _link_finding(link: SlowLink, hosts: dict[int, str]) -> Finding:
    ends = [(r, hosts.get(r, "")) for r in (link.rank, link.peer)]
    named = " and ".join(f"rank {r}{f' ({h})' if h else ''}" for r, h in ends)
    return Finding(
        cause="communication",
        ranks=[link.rank, link.peer],
        hosts=sorted({h for _, h in ends if h}),
        function=link.pattern,
        confidence=round(effect(link.ratio) * link.windows_flagged / max(link.windows, 1), 3),
        summary=(
            f"the link between {named} is slow — it moves {link.gbps:.3g} GB/s where the job's links "
            f"like it move {link.peer_gbps:.3g} GB/s ({link.ratio:.2f}x the time per byte), while each "
            "end sends at its peers' speed on its other links: look at the path between the two "
            "(a cable, a port, a route), not at either host"
        ),
        evidence={
            "metric": "network send time per byte on the link, both ways, without the wait for peers",
            "link_gbps": round(link.gbps, 3),
            "peer_median_gbps": round(link.peer_gbps, 3),
            "ratio": round(link.ratio, 3),
            **_held(link),
        },
        scope="link",
    )


def _finding(link: SlowLink, hosts: dict[int, str]) -> Finding:
    host = hosts.get(link.rank, "")
    held = _held(link)
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
