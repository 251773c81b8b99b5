"""Records in, findings out: hangs, stragglers with their cause, topology, job-wide slowdowns."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from wire import records

from . import communication, contention, functions, hangs, jobwide, stragglers, topology
from .classify import CPU_WAIT, UNATTRIBUTED, classify, wait_evidence
from .data import JobData
from .findings import Diagnosis, Finding, effect, ms


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    steps: stragglers.StragglerSettings = field(default_factory=stragglers.StragglerSettings)
    hangs: hangs.HangSettings = field(default_factory=hangs.HangSettings)
    comm: communication.CommunicationSettings = field(default_factory=communication.CommunicationSettings)
    contention: contention.ContentionSettings = field(default_factory=contention.ContentionSettings)
    job_wide: jobwide.JobWideSettings = field(default_factory=jobwide.JobWideSettings)
    min_confidence: float = 0.3
    """Findings below this confidence are not reported."""


def _contention_finding(c: contention.Contended, hosts: dict[int, str]) -> Finding:
    host = hosts.get(c.rank, "")
    return Finding(
        cause="host_contention",
        ranks=[c.rank],
        hosts=[host] if host else [],
        function=CPU_WAIT,
        confidence=round(effect(1 + c.step_share) * c.windows_flagged / max(c.windows, 1), 3),
        summary=(
            f"rank {c.rank}{f' ({host})' if host else ''}: CPU contention — its threads wait "
            f"{ms(c.wait_us)} ms per step for a CPU where its peers' wait {ms(c.peer_wait_us)} ms "
            f"(the step takes {ms(c.step_us)} ms); its collectives' and data threads fall behind "
            f"and every rank waits for them. Look for other processes on its cores"
        ),
        evidence={"metric": "run-queue wait of the rank's threads per step (schedstat)", **wait_evidence(c)},
    )


def _straggler_findings(
    sts: list[stragglers.Straggler],
    data: JobData,
    hosts: dict[int, str],
    waits: dict[int, contention.Contended],
) -> list[Finding]:
    if not sts:
        return []
    culprits = [st.rank for st in sts]
    everyone = data.ranks["rank"] if not data.ranks.empty else data.steps["rank"]
    ranks = np.unique(everyone.to_numpy(dtype=np.int64))
    # The peers are the ranks that are not culprits themselves (all others when everybody is one),
    # evenly spread as functions.pick_peers does, without a Python list of every rank.
    rest = ranks[~np.isin(ranks, culprits)]
    rest = rest if rest.size else ranks
    if rest.size > functions.MAX_PEERS:
        rest = rest[(np.arange(functions.MAX_PEERS) * (rest.size / functions.MAX_PEERS)).astype(np.int64)]
    peers = [int(r) for r in rest]
    fs = data.functions
    if not fs.empty:  # one pass over the functions of every rank, not one per culprit
        fs = fs[fs["rank"].isin([*culprits, *peers])]
    return [
        _straggler_finding(
            st, fs, data.steps, data.samples, [p for p in peers if p != st.rank], hosts, waits.get(st.rank)
        )
        for st in sts
    ]


def _straggler_finding(
    st: stragglers.Straggler,
    fs: pd.DataFrame,
    steps: pd.DataFrame,
    samples: pd.DataFrame,
    peers: list[int],
    hosts: dict[int, str],
    waits: contention.Contended | None,
) -> Finding:
    if not fs.empty:
        # The windows that caught it slow say where its extra time goes; those before the fault
        # began (or between its bursts) would dilute a code path it has taken since. Found at a
        # change, those before it are left out first: a rank whose gradient hook began at step
        # 509 was slow by chance in a window at step 484, and only there.
        mine = fs[fs["rank"] == st.rank]
        if st.before_ratio > 0 and (mine["step_hi"] > st.since_step).any():
            mine = mine[mine["step_hi"] > st.since_step]
            fs = fs[fs["window"].isin(mine["window"].unique())]
        slow = stragglers.slow_windows(steps, mine, st, peers)
        if slow:
            fs = fs[fs["window"].isin(slow)]
    excess = functions.compare(fs, st.rank, peers)
    # A tenth of the rank's time in one function of its code beyond its peers' share: a stall
    # that took that much of the job is no sampling noise (±3 samples in the 60 of 30 s).
    sampled = functions.top_sampled(samples, st.rank, peers, min_share=0.1)
    why = classify(st, excess, waits, sampled)
    cause, fn, explained = why.cause, why.function, why.cause_share
    held = min(max(why.function_share, 0.0), 1.0)
    windows = int(fs.loc[fs["rank"] == st.rank, "window"].nunique()) if not fs.empty else 0
    confidence = round(effect(st.growth) * st.persistence * min(1.0, max(0.5, explained)), 3)
    host = hosts.get(st.rank, "")
    evidence = {
        "metric": "own time per step = step time - time waiting in collectives and for a CPU",
        "rank_value_ms": ms(st.own_us),
        "peer_median_ms": ms(st.peer_own_us),
        "ratio": round(st.ratio, 3),
        "chunks_flagged": f"{st.chunks_flagged}/{st.chunks}",
        "held_since_step": st.since_step,
        "held_steps": st.held_steps,
        "held_s": round(st.held_steps * (st.own_us + st.comm_us) / 1e6, 1),
        **({"ratio_before": round(st.before_ratio, 3)} if st.before_ratio else {}),
        "profiled_windows": windows,
        "collective_wait_ms": ms(st.comm_us),
        "peer_collective_wait_ms": ms(st.peer_comm_us),
        "explained_share": round(min(explained, 1.0), 3),
        "function_share": round(held, 3),
        **why.evidence,
    }
    summary = (
        f"rank {st.rank}{f' ({host})' if host else ''}: {cause} straggler — it works "
        f"{st.ratio:.2f}x as long per step as its peers ({ms(st.own_us)} vs {ms(st.peer_own_us)} ms), "
        + (
            f"{held:.0%} of the extra time in {fn}"
            if fn != UNATTRIBUTED
            else "no profiled operator or function, and no stack sample, holds the extra time"
        )
        + f"; peers wait {ms(st.peer_comm_us - st.comm_us)} ms "
        f"longer in collectives for it"
        + (f" (it was {st.before_ratio:.2f}x until step {st.since_step})" if st.before_ratio else "")
        + (
            f", in bursts: slow in {st.chunks_flagged} of the last {st.chunks} spans of steps"
            if st.bursts
            else ""
        )
    )
    return Finding(
        cause=cause,
        ranks=[st.rank],
        hosts=[host] if host else [],
        function=fn,
        confidence=confidence,
        summary=summary,
        evidence=evidence,
    )


def _comm_finding(link: communication.SlowLink, hosts: dict[int, str]) -> Finding:
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


_LIBRARY_PATH = re.compile(r'File "(<[^"]*>|[^"]*(-packages/|/lib/python3[.\d]*/|/profiler_hook/)[^"]*)"')
"""A stack frame of the interpreter, the standard library, an installed package or the hook."""


def _hang_finding(h: hangs.Hang, hosts: dict[int, str]) -> Finding:
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


def _collective_waits(
    contended: Iterable[contention.Contended], sts: list[stragglers.Straggler], steps: pd.DataFrame
) -> pd.Series:
    """The median collective wait per step of the contended ranks and the stragglers, by rank, over
    the steps since both held: before a fault began nobody waited for its rank."""
    contended = list(contended)
    first = max(min(c.since_step for c in contended), min(st.since_step for st in sts))
    since = steps[steps["step"] >= first]
    ranks = [*(c.rank for c in contended), *(st.rank for st in sts)]
    return since[since["rank"].isin(ranks)].groupby("rank")["comm_us"].median()


def _waited_for(
    found: list[contention.Contended],
    sts: list[stragglers.Straggler],
    steps: pd.DataFrame,
    s: contention.ContentionSettings,
) -> dict[int, contention.Contended]:
    """The contended ranks by rank, less those the job does not wait for: a rank holding the job
    back waits in the collectives as little as any (its collectives' threads are slow: every rank
    waits alike) or less (its training thread queues too, and it arrives late). On shared cores the
    threads of a rank that keeps pace can queue as well: in a job whose rank 3's data loader
    stalled, rank 1's threads queued 1.5x as long as the others' in 2 of 2 windows, and it waited
    27.9 ms per step in the collectives where rank 3, whom every rank waited for, waited 12.9 ms.
    (Three such findings in three runs, at 1.15, 2.2 and 2.3x the straggler's wait.) Both are
    measured on the same steps, those since the contention and the stragglers held: before a
    straggler's fault began nobody waited for it, and every rank's wait was as small as its. A
    straggler contended itself is one the job waits for too."""
    out = {c.rank: c for c in found}
    if not found or not sts or steps.empty:
        return out
    comm = _collective_waits(found, sts, steps)

    def waited_for(rank: int) -> bool:
        least = min((comm[st.rank] for st in sts if st.rank != rank and st.rank in comm), default=math.inf)
        return rank not in comm or comm[rank] <= s.waited_for * least

    return {r: c for r, c in out.items() if waited_for(r)}


def _not_waiting(
    sts: list[stragglers.Straggler],
    contended: dict[int, contention.Contended],
    steps: pd.DataFrame,
    s: contention.ContentionSettings,
) -> list[stragglers.Straggler]:
    """The stragglers, less those waiting for a contended rank: the rank the job waits for waits
    in the collectives the least (the wait inversion), and a straggler whose collective wait per
    step is over a contended rank's by ``waited_for`` is a peer that waits, whatever part of its
    wait the hook could not tell from its own time (with one host of two hogged, the other host's
    ranks were named ``compute`` beside the right ``host_contention`` finding). The other side of
    :func:`_waited_for`, on the same steps: those since both held."""
    if not contended or not sts or steps.empty:
        return sts
    comm = _collective_waits(contended.values(), sts, steps)
    least = min((comm[r] for r in contended if r in comm), default=math.inf)
    return [
        st
        for st in sts
        if st.rank in contended or st.rank not in comm or comm[st.rank] <= s.waited_for * least
    ]


def _stragglers(steps: pd.DataFrame, s: stragglers.StragglerSettings) -> list[stragglers.Straggler]:
    """The peer rule's stragglers, then the change-point rule's; a rank both find is described by
    the surer of the two (slow since step N in every chunk since, rather than in half of the last
    800 steps). Each rank's change point is measured against the ranks not found slow."""
    found = {st.rank: st for st in stragglers.find(steps, s)}
    slow = set(found)
    for st in stragglers.shifted(steps, s, exclude=slow):
        found[st.rank] = st
    for rank in slow:
        for st in stragglers.shifted(steps, s, exclude=slow - {rank}):
            if st.rank == rank and st.strength > found[rank].strength:
                found[rank] = st
    return sorted(found.values(), key=lambda st: st.rank)


def coverage_gaps(ranks: pd.DataFrame) -> list[str]:
    """What some ranks' hooks do not see, each gap once with the ranks it is on
    (``"DDP Net on world: not tracked (...) (ranks 0, 1)"``), from the rank records' ``coverage``."""
    if "coverage" not in ranks:
        return []
    on: dict[str, list[int]] = {}
    for rank, coverage in zip(ranks["rank"], ranks["coverage"], strict=True):
        for gap in records.coverage_gaps(str(coverage)):
            on.setdefault(gap, []).append(int(rank))
    return [f"{gap} ({_ranks(rs)})" for gap, rs in sorted(on.items())]


def _ranks(ranks: list[int], most: int = 8) -> str:
    rs = sorted(set(ranks))
    said = ", ".join(map(str, rs[:most])) + (f" and {len(rs) - most} more" if len(rs) > most else "")
    return f"rank{'s' if len(rs) > 1 else ''} {said}"


def diagnose(data: JobData, settings: Settings | None = None) -> Diagnosis:
    """Analyze one job's records; findings ranked by confidence (empty for a healthy job)."""
    s = settings or Settings()
    t0 = time.perf_counter()
    found: list[Finding] = []
    hang = hangs.find(data.heartbeats, s.hangs)
    sts = _stragglers(data.steps, s.steps)
    links = communication.find(data.functions, s.comm, data.ranks, data.links)
    # Precedence between the two accounts of who holds the job back: a contended rank that waits
    # for a straggler is none, and then a straggler that waits for a contended rank is none.
    waits = _waited_for(
        contention.find(data.functions, data.steps, s.contention), sts, data.steps, s.contention
    )
    sts = _not_waiting(sts, waits, data.steps, s.contention)
    # Host names of the culprits only: a dict of every rank costs 0.1 s at 100,000 ranks.
    culprits = [
        *(hang.ranks if hang else []),
        *(st.rank for st in sts),
        *(link.rank for link in links),
        *waits,
    ]
    r = data.ranks
    hosts = JobData(job=data.job, ranks=r[r["rank"].isin(culprits)]).hosts() if culprits else {}
    if hang is not None:
        found.append(_hang_finding(hang, hosts))
    # A contended rank need not work longer itself: the threads that queue may be the collectives'.
    # One that does too is told by the surer account: on a host whose hogs take its cores, a rank's
    # own time rose 1.08x (a compute straggler at 0.41) while its threads waited 1.6x its peers' in
    # every window (contention at 0.96).
    contended = {rank: _contention_finding(c, hosts) for rank, c in waits.items()}
    for f in _straggler_findings(sts, data, hosts, waits):
        c = contended.pop(f.ranks[0], None)
        found.append(c if c is not None and c.confidence > f.confidence else f)
    found += contended.values()
    found += [_comm_finding(link, hosts) for link in links]
    found = topology.group(found, data.ranks)
    if not found:
        jw = jobwide.find(data, s.job_wide, s.steps)
        found = [jw] if jw else []
    found = sorted((f for f in found if f.confidence >= s.min_confidence), key=lambda f: -f.confidence)
    steps = data.steps["step"]
    analyzed = {
        "ranks": int(data.steps["rank"].nunique()) if not data.steps.empty else len(data.ranks),
        "steps": [int(steps.min()), int(steps.max())] if not steps.empty else [],
        "windows": int(data.functions["window"].nunique()) if not data.functions.empty else 0,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if gaps := coverage_gaps(data.ranks):
        analyzed["coverage_gaps"] = gaps
    return Diagnosis(job=data.job, findings=found, analyzed=analyzed)
