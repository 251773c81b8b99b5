"""``straggler``: the ranks that hold the job back — by working longer per step than their peers
(``compute``, ``dataloader``, ``code_path``: which one, and in which function, from where the extra
time went) or by their threads waiting for a CPU (``host_contention``).

The two accounts are one detector because each decides the other: a contended rank that waits for
a straggler is no culprit, and then a straggler that waits for a contended rank is none; a rank both
name is told by the surer account.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from rankscope.wire.settings import check_numbers

from ...data import JobData
from ...findings import Finding, effect, ms
from ...robust import evenly
from . import contention, functions, shift
from .cause import ACROSS_OPERATORS, CPU_WAIT, UNATTRIBUTED, classify, wait_evidence
from .peers import slow_windows, slower_than_peers
from .rank import Straggler, StragglerSettings


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    steps: StragglerSettings = field(default_factory=StragglerSettings)
    """Who is slow, against its peers and against its own past (``stragglers``)."""
    contention: contention.ContentionSettings = field(default_factory=contention.ContentionSettings)
    """Whose threads wait for a CPU (``contention``), and whom the job waits for."""

    def __post_init__(self) -> None:
        check_numbers(self)


def find(data: JobData, s: Settings) -> list[Finding]:
    """The stragglers and the contended ranks the job waits for, one finding per rank; of a job
    whose ranks have roles (pipeline stages, ``JobData.roles``), each measured against its role's."""
    roles = data.roles()
    role_of = {r: k for k, ranks in enumerate(roles) for r in ranks} if len(roles) > 1 else {}
    sts = _stragglers(data, s.steps, roles if role_of else [], role_of)
    # Precedence between the two accounts of who holds the job back: a contended rank that waits
    # for a straggler is none, and then a straggler that waits for a contended rank is none.
    waits = _waited_for(
        contention.find(data.functions, data.steps, s.contention, data.hosts(), roles),
        sts,
        data.steps,
        s.contention,
    )
    sts = _not_waiting(sts, waits, data.steps, s.contention)
    # The wait inversion: the rank the job waits for waits in the collectives the least. One that
    # waits longer than its peers there holds no one back, whatever its own time reads (part of a
    # wait the hook could not tell from its own work, say): the job waits elsewhere.
    sts = [st for st in sts if st.comm_us <= st.peer_comm_us]
    hosts = data.hosts_of([*(st.rank for st in sts), *waits])
    # A contended rank need not work longer itself: the threads that queue may be the collectives'.
    # One that does too is told by the surer account: on a host whose hogs take its cores, a rank's
    # own time can rise 1.08x (a weak compute straggler) while its threads wait 1.6x its peers' in
    # every window (a sure contention finding).
    contended = {rank: _contention_finding(c, hosts) for rank, c in waits.items()}
    found = []
    for f in _straggler_findings(sts, data, hosts, waits, role_of):
        c = contended.pop(f.ranks[0], None)
        found.append(c if c is not None and c.confidence > f.confidence else f)
    return found + list(contended.values())


METRIC = {
    "windows": "run-queue wait of the rank's threads per step (schedstat, profiling windows)",
    "steps": "run-queue wait of the rank's training thread per step (schedstat, every step)",
}


def _contention_finding(c: contention.Contended, hosts: dict[int, str]) -> Finding:
    host = hosts.get(c.rank, "")
    return Finding(
        cause="host_contention",
        ranks=[c.rank],
        hosts=[host] if host else [],
        function=CPU_WAIT,
        confidence=round(effect(1 + c.step_share) * c.windows_flagged / max(c.windows, 1), 3),
        summary=(
            f"rank {c.rank}{f' ({host})' if host else ''}: CPU contention — its "
            f"{'threads wait' if c.measured == 'windows' else 'training thread waits'} "
            f"{ms(c.wait_us)} ms per step for a CPU where its peers' wait {ms(c.peer_wait_us)} ms "
            f"(the step takes {ms(c.step_us)} ms); it falls behind, and every rank waits for it "
            f"in the collectives. Look for other processes on its cores"
        ),
        evidence={"metric": METRIC[c.measured], **wait_evidence(c)},
    )


def _straggler_findings(
    sts: list[Straggler],
    data: JobData,
    hosts: dict[int, str],
    waits: dict[int, contention.Contended],
    role_of: dict[int, int],
) -> list[Finding]:
    if not sts:
        return []
    culprits = [st.rank for st in sts]
    everyone = data.ranks["rank"] if not data.ranks.empty else data.steps["rank"]
    ranks = np.unique(everyone.to_numpy(dtype=np.int64))
    # The peers are the ranks that are not culprits themselves (all others when everybody is one),
    # evenly spread (``robust.evenly``), without a Python list of every rank; of a job
    # with roles, those of the culprit's role.
    rest = ranks[~np.isin(ranks, culprits)]
    rest = rest if rest.size else ranks

    def peers_of(rank: int) -> list[int]:
        rs = rest
        if role_of and (same := rs[np.array([role_of.get(int(r)) == role_of.get(rank) for r in rs])]).size:
            rs = same
        return [int(r) for r in evenly(rs, functions.MAX_PEERS)]

    peers = {st.rank: peers_of(st.rank) for st in sts}
    fs = data.functions_of({r for st in sts for r in (st.rank, *peers[st.rank])})  # one read for all
    return [
        _straggler_finding(
            st,
            fs,
            data.steps,
            _samples(data, st),
            [p for p in peers[st.rank] if p != st.rank],
            hosts,
            waits.get(st.rank),
        )
        for st in sts
    ]


def _samples(data: JobData, st: Straggler) -> pd.DataFrame:
    """The stack samples since the straggler became one, where that was within the span read:
    those from before dilute the stall it has had since (a rank whose metrics upload blocks 15 ms
    a step from 12 s into a 60 s run: 24 of its 98 samples there, 24 of its 68 since)."""
    steps = data.steps
    if "start_us" not in steps:  # built in memory without times: the samples of the span
        return data.samples
    mine = steps.loc[steps["rank"] == st.rank, ["step", "start_us"]]
    since = mine.loc[mine["step"] >= st.since_step, "start_us"]
    if since.empty or since.min() <= mine["start_us"].min():
        return data.samples
    return data.samples_since(int(since.min()))


def _straggler_finding(
    st: Straggler,
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
        # change, those before it are left out first: a window shortly before the change can catch
        # the rank slow by chance, and would name what ran there.
        mine = fs[fs["rank"] == st.rank]
        if st.before_ratio > 0 and (mine["step_hi"] > st.since_step).any():
            mine = mine[mine["step_hi"] > st.since_step]
            fs = fs[fs["window"].isin(mine["window"].unique())]
        slow = slow_windows(steps, mine, st, peers)
        if slow:
            fs = fs[fs["window"].isin(slow)]
    excess = functions.compare(fs, st.rank, peers)
    sampled = functions.top_sampled(samples, st.rank, peers)
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
        + _where(fn, held, why.evidence)
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


def _where(fn: str, held: float, evidence: dict[str, Any]) -> str:
    """Where the summary says the extra time went."""
    if fn == UNATTRIBUTED:
        return "no profiled operator or function, and no stack sample, holds the extra time"
    if fn == ACROSS_OPERATORS:
        top = ", ".join(f"{name} {share:.0%}" for name, share in evidence["largest"].items())
        return f"its operators are slower across the board, none holding half the extra time ({top})"
    where = f"{held:.0%} of the extra time in {fn}"
    if "gc_ms_per_step" in evidence:
        where += (
            f", the garbage collector stopping it {evidence['gc_ms_per_step']} ms per step "
            f"({evidence['peer_gc_ms_per_step']} ms its peers)"
        )
    return where


def _collective_waits(
    contended: Iterable[contention.Contended], sts: list[Straggler], steps: pd.DataFrame
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
    sts: list[Straggler],
    steps: pd.DataFrame,
    s: contention.ContentionSettings,
) -> dict[int, contention.Contended]:
    """The contended ranks by rank, less those the job does not wait for: a rank holding the job
    back waits in the collectives as little as any (its collectives' threads are slow: every rank
    waits alike) or less (its training thread queues too, and it arrives late). On shared cores the
    threads of a rank that keeps pace can queue as well: next to a straggler (a stalling data
    loader, a blocking callback, a slower device) a rank's threads can queue 1.5x as long as the
    others' in every window while it waits 1.15-2.3x as long as the straggler in the collectives.
    Both are measured on the same steps, those since the contention and the stragglers held: before
    a straggler's fault began nobody waited for it, and every rank's wait was as small as its. A
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
    sts: list[Straggler],
    contended: dict[int, contention.Contended],
    steps: pd.DataFrame,
    s: contention.ContentionSettings,
) -> list[Straggler]:
    """The stragglers, less those waiting for a contended rank: the rank the job waits for waits
    in the collectives the least (the wait inversion), and a straggler whose collective wait per
    step is over a contended rank's by ``waited_for`` is a peer that waits, whatever part of its
    wait the hook could not tell from its own time (with one host of two hogged, the other host's
    ranks would be named ``compute`` beside the right ``host_contention`` finding). The other side of
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


def _stragglers(
    data: JobData, s: StragglerSettings, roles: list[list[int]], role_of: dict[int, int]
) -> list[Straggler]:
    """The peer rule's stragglers, then the change-point rule's; a rank both find is described by
    the surer of the two (slow since step N in every chunk since, rather than in half of the last
    800 steps). Each rank's change point is measured against the ranks not found slow: of its role,
    where the job's ranks have ``roles`` (each a list of ranks)."""
    steps = data.steps
    found = {st.rank: st for st in slower_than_peers(steps, s, role_of)}
    slow = set(found)
    every: list[list[int] | None] = [None]  # no roles: all ranks at once
    for role in roles or every:
        mine = steps if role is None else data.of_ranks(role).steps
        cut = shift.shift_grid(mine, s)  # the same steps for every call
        for st in shift.shifted(mine, s, exclude=slow, cut=cut):
            found[st.rank] = st
        for rank in slow if role is None else slow & set(role):
            for st in shift.shifted(mine, s, exclude=slow - {rank}, cut=cut, only=rank):
                if st.strength > found[rank].strength:
                    found[rank] = st
    return sorted(found.values(), key=lambda st: st.rank)
