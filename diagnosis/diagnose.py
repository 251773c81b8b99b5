"""Records in, findings out: hangs, stragglers with their cause, topology, job-wide slowdowns."""

from __future__ import annotations

import math
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from . import communication, contention, functions, hangs, stragglers
from .data import JobData
from .findings import Diagnosis, Finding


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    steps: stragglers.Settings = field(default_factory=stragglers.Settings)
    hangs: hangs.HangSettings = field(default_factory=hangs.HangSettings)
    comm: communication.CommSettings = field(default_factory=communication.CommSettings)
    contention: contention.ContentionSettings = field(default_factory=contention.ContentionSettings)
    job_wide_ratio: float = 1.3
    """All ranks' step time grew by this factor from the first to the last chunks: job-wide..."""
    job_wide_own_ratio: float = 1.5
    job_wide_step_ratio: float = 1.05
    """...or all ranks' own time grew by ``job_wide_own_ratio`` while step time grew by
    ``job_wide_step_ratio`` at least (where collectives dominate the step, waiting absorbs part of
    everybody's slower work; own time alone drifts up to ~1.3x on a healthy, oversubscribed host)."""
    job_wide_steps: int = 3000
    """Steps the job-wide rule looks back over, longer than the stragglers' ``steps.last_steps``: it
    compares the latest chunks with the first, which is the job's own start in a younger job."""
    job_wide_min_s: float = 20.0
    """...and only once those steps span this many seconds: the first seconds of a job (imports on
    background threads, allocator and cache warm-up, the first profiling windows) are no baseline.
    On the DDP healthy control, 6-14 s in, they read as a 1.3-1.4x job-wide slowdown."""
    min_confidence: float = 0.3
    """Findings below this confidence are not reported."""


def _ms(us: float) -> float:
    return round(us / 1e3, 3)


def _effect(ratio: float) -> float:
    """0 for no deviation, ~0.74 at 1.2x, ~0.96 at 1.5x."""
    return 1.0 - math.exp(-max(ratio - 1.0, 0.0) / 0.15)


def _classify(
    st: stragglers.Straggler, excess: list[functions.FunctionExcess], waits: contention.Contended | None
) -> tuple[str, str, float, dict[str, Any]]:
    """(cause, function, share of the excess it explains, evidence) for one straggler."""
    total = max(st.excess_us, 1.0)
    # Starved: the rank got a smaller share of the CPU for its own time than its peers. (A rank with
    # more work queues longer on a busy host too, behind its own threads, at the same share.)
    own_eff = st.cpu_us / max(st.own_us, 1.0)
    peer_eff = st.peer_cpu_us / max(st.peer_own_us, 1.0)
    starved = own_eff <= 0.8 * peer_eff
    ev: dict[str, Any]
    if starved and waits is not None and waits.wait_us - waits.peer_wait_us >= 0.5 * total:
        ev = {
            **_wait_evidence(waits),
            "cpu_share_of_own_time": round(own_eff, 3),
            "peer_cpu_share_of_own_time": round(peer_eff, 3),
        }
        return "host_contention", CPU_WAIT, 1.0, ev
    data_excess = st.data_us - st.peer_data_us
    if data_excess >= 0.5 * total:
        fn = functions.top_of_kind(excess, "dataloader")
        loader = fn.name if fn else "DataLoader.__next__"
        ev = {"data_wait_ms": _ms(st.data_us), "peer_data_wait_ms": _ms(st.peer_data_us)}
        code = functions.innermost_code(excess, 0.3 * data_excess)  # a window sees most fetches, not all
        if code is None:
            return "dataloader", loader, data_excess / total, ev
        return "dataloader", code.name, data_excess / total, {**ev, **_code_evidence(code), "loader": loader}
    extra = functions.top_extra(excess)
    if extra is not None and extra.excess_us >= 0.3 * total:
        code = functions.innermost_code(excess, 0.5 * extra.excess_us) or extra
        ev = {
            **_code_evidence(code),
            "calls_per_step": round(extra.rank_count, 2),
            "peer_calls_per_step": round(extra.peer_count, 2),
        }
        if code is not extra:
            ev["entered_through"] = extra.name
        op = functions.top_of_kinds(excess, functions.WORK_KINDS)
        if op is not None:
            ev["operator"] = op.name
        return "code_path", code.name, extra.excess_us / total, ev
    slower = functions.top_slower(excess)
    slow_code = functions.innermost_code(excess, 0.5 * total)
    if slow_code is not None and functions.work_excess(excess) < 0.5 * slow_code.excess_us:
        # The job's own function takes longer on this rank, but not in operators: it blocks or
        # waits (a synchronous upload, a lock, I/O). A slower device slows the operators under it.
        ev = {**_code_evidence(slow_code), "calls_per_step": round(slow_code.rank_count, 2)}
        return "code_path", slow_code.name, slow_code.excess_us / total, ev
    if starved and st.nivcsw >= 2 * st.peer_nivcsw + 5:
        ev = {
            "involuntary_switches_per_step": st.nivcsw,
            "peer_involuntary_switches_per_step": st.peer_nivcsw,
            "cpu_share_of_own_time": round(own_eff, 3),
            "peer_cpu_share_of_own_time": round(peer_eff, 3),
        }
        return "host_contention", "(whole process)", 1.0, ev
    ev = {}
    if slower is not None:
        ev = {
            "operator_ms_per_step": _ms(slower.rank_us),
            "operator_peer_ms_per_step": _ms(slower.peer_us),
            "operator_ratio": round(slower.rank_us / max(slower.peer_us, 1e-9), 3),
            "calls_per_step": round(slower.rank_count, 2),
        }
    compute_excess = (st.own_us - st.data_us) - (st.peer_own_us - st.peer_data_us)
    name = slower.name if slower else "compute (no profiling window covered it)"
    # Forward runs in the job's code, backward mostly in the autograd engine: a third will do.
    code = functions.innermost_code(excess, 0.3 * compute_excess) if slower else None
    if code is not None:  # the job's own function whose operators got slower, and the operator
        ev = {**ev, **_code_evidence(code), "operator": name}
        name = code.name
    return "compute", name, compute_excess / total, ev


def _code_evidence(code: functions.FunctionExcess) -> dict[str, Any]:
    return {
        "stack": code.stack,
        "function_ms_per_step": _ms(code.rank_us),
        "function_peer_ms_per_step": _ms(code.peer_us),
    }


CPU_WAIT = "(threads waiting for a CPU)"


def _wait_evidence(c: contention.Contended) -> dict[str, Any]:
    return {
        "cpu_wait_ms_per_step": _ms(c.wait_us),
        "peer_cpu_wait_ms_per_step": _ms(c.peer_wait_us),
        "wait_ratio": round(c.ratio, 3),
        "step_ms": _ms(c.step_us),
        "windows_flagged": f"{c.windows_flagged}/{c.windows}",
    }


def _contention_finding(c: contention.Contended, hosts: dict[int, str]) -> Finding:
    host = hosts.get(c.rank, "")
    return Finding(
        cause="host_contention",
        ranks=[c.rank],
        hosts=[host] if host else [],
        function=CPU_WAIT,
        confidence=round(_effect(1 + c.step_share) * c.windows_flagged / max(c.windows, 1), 3),
        summary=(
            f"rank {c.rank}{f' ({host})' if host else ''}: CPU contention — its threads wait "
            f"{_ms(c.wait_us)} ms per step for a CPU where its peers' wait {_ms(c.peer_wait_us)} ms "
            f"(the step takes {_ms(c.step_us)} ms); its collectives' and data threads fall behind "
            f"and every rank waits for them. Look for other processes on its cores"
        ),
        evidence={"metric": "run-queue wait of the rank's threads per step (schedstat)", **_wait_evidence(c)},
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
        _straggler_finding(st, fs, [p for p in peers if p != st.rank], hosts, waits.get(st.rank))
        for st in sts
    ]


def _straggler_finding(
    st: stragglers.Straggler,
    fs: pd.DataFrame,
    peers: list[int],
    hosts: dict[int, str],
    waits: contention.Contended | None,
) -> Finding:
    excess = functions.compare(fs, st.rank, peers)
    cause, fn, explained, ev = _classify(st, excess, waits)
    windows = int(fs.loc[fs["rank"] == st.rank, "window"].nunique()) if not fs.empty else 0
    persistence = st.chunks_flagged / max(st.chunks, 1)
    confidence = round(_effect(st.growth) * persistence * min(1.0, max(0.5, explained)), 3)
    host = hosts.get(st.rank, "")
    evidence = {
        "metric": "own time per step = step time - time waiting in collectives",
        "rank_value_ms": _ms(st.own_us),
        "peer_median_ms": _ms(st.peer_own_us),
        "ratio": round(st.ratio, 3),
        "chunks_flagged": f"{st.chunks_flagged}/{st.chunks}",
        "held_since_step": st.since_step,
        "held_steps": st.held_steps,
        "held_s": round(st.held_steps * (st.own_us + st.comm_us) / 1e6, 1),
        **({"ratio_before": round(st.before_ratio, 3)} if st.before_ratio else {}),
        "profiled_windows": windows,
        "collective_wait_ms": _ms(st.comm_us),
        "peer_collective_wait_ms": _ms(st.peer_comm_us),
        "explained_share": round(min(explained, 1.0), 3),
        **ev,
    }
    summary = (
        f"rank {st.rank}{f' ({host})' if host else ''}: {cause} straggler — it works "
        f"{st.ratio:.2f}x as long per step as its peers ({_ms(st.own_us)} vs {_ms(st.peer_own_us)} ms), "
        f"most of the extra time in {fn}; peers wait {_ms(st.peer_comm_us - st.comm_us)} ms "
        f"longer in collectives for it"
        + (f" (it was {st.before_ratio:.2f}x until step {st.since_step})" if st.before_ratio else "")
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
    return Finding(
        cause="communication",
        ranks=[link.rank],
        hosts=[host] if host else [],
        function=link.pattern,
        confidence=round(_effect(link.ratio) * link.windows_flagged / max(link.windows, 1), 3),
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
            "windows_flagged": f"{link.windows_flagged}/{link.windows}",
        },
    )


_LEVELS = (("nic", ("rank",)), ("host", ("rank", "nic")), ("switch", ("rank", "nic", "host")))
"""Each topology level and the finding scopes it merges; a NIC only for communication culprits."""


def _group_topology(found: list[Finding], ranks: pd.DataFrame) -> list[Finding]:
    """Culprits that make up a whole NIC, host or switch become one finding naming it."""
    for label, below in _LEVELS:
        if ranks.empty or label not in ranks:
            continue
        cands = [
            f
            for f in found
            if f.scope in below
            and (f.scope != "rank" or len(f.ranks) == 1)
            and (label != "nic" or f.cause == "communication")
        ]
        if not cands:
            continue
        culprit = {r for f in cands for r in f.ranks}
        lab = ranks[["rank", label]].astype({"rank": "int64", label: str})
        label_of = dict(lab[lab["rank"].isin(culprit)].itertuples(index=False, name=None))
        if lab[label].nunique() < 2:
            continue
        by_key: dict[tuple[str, str], list[Finding]] = defaultdict(list)
        for f in cands:
            places = {label_of.get(r, "") for r in f.ranks}
            if len(places) == 1:
                by_key[(f.cause, places.pop())].append(f)
        wanted = {w for _, w in by_key if w}
        mine = lab[lab[label].isin(wanted)]
        members = {w: sorted(g.tolist()) for w, g in mine.groupby(label)["rank"]}
        merged_ids: set[int] = set()
        merged: list[Finding] = []
        for (cause, where), fs in by_key.items():
            covered = sorted(r for f in fs for r in f.ranks)
            if not where or len(members.get(where, [])) < 2 or covered != members[where]:
                continue
            per_rank: dict[int, Any] = {}
            for f in fs:
                per_rank.update(
                    f.evidence.get("per_rank", {}) if f.scope != "rank" else {f.ranks[0]: f.evidence}
                )
            merged_ids.update(id(f) for f in fs)
            merged.append(
                Finding(
                    cause=cause,
                    ranks=covered,
                    hosts=sorted({h for f in fs for h in f.hosts}),
                    function=Counter(f.function for f in fs).most_common(1)[0][0],
                    confidence=round(sum(f.confidence for f in fs) / len(fs), 3),
                    summary=(
                        f"{label} {where}: all its {len(covered)} ranks {_some(covered)} are {cause} "
                        f"{'culprits' if cause == 'communication' else 'stragglers'}; look at the {label}"
                    ),
                    evidence={label: where, "per_rank": per_rank},
                    scope=label,
                )
            )
        found = [f for f in found if id(f) not in merged_ids] + merged
    return found


def _some(ranks: list[int], n: int = 8) -> str:
    return str(ranks) if len(ranks) <= n else f"[{', '.join(map(str, ranks[:n]))}, ...]"


def _job_wide(data: JobData, s: Settings) -> Finding | None:
    recent = data.steps[data.steps["step"] > data.steps["step"].max() - s.job_wide_steps]
    if recent.empty or recent.groupby("step")["dur_us"].median().sum() < s.job_wide_min_s * 1e6:
        return None
    g = stragglers.grid(data.steps, replace(s.steps, last_steps=s.job_wide_steps), ["dur_us", "own_us"])
    if g is None or len(np.unique(g.chunk)) < 3:
        return None
    last = sorted(np.unique(g.chunk))
    growth: dict[str, tuple[float, np.ndarray]] = {}
    for col in ("dur_us", "own_us"):
        per = stragglers.chunk_medians(g, col, s.steps.chunks)  # rank x chunk
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = min(float(stragglers.nanmedian(per[:, c] / per[:, last[0]], axis=0)) for c in last[-2:])
        growth[col] = (ratio, per)
    # Step time carries every slowdown but also the job's tail (each step waits for its slowest
    # rank); own time is free of that noise for compute and data slowdowns. Own time alone is not
    # enough: the job must have become measurably slower too.
    step_ratio, own_ratio = growth["dur_us"][0], growth["own_us"][0]
    col = "dur_us"
    step_grew = step_ratio >= 1 + (s.job_wide_ratio - 1) / 2
    if own_ratio > step_ratio and (
        step_grew or (step_ratio >= s.job_wide_step_ratio and own_ratio >= s.job_wide_own_ratio)
    ):
        col = "own_us"
    ratio, per = growth[col]
    if not ratio >= s.job_wide_ratio:
        return None
    ranks = [int(r) for r in g.ranks]
    what = "step time" if col == "dur_us" else "own time per step (outside collectives)"
    return Finding(
        cause="job_wide",
        ranks=ranks,
        hosts=sorted(set(data.hosts().values())),
        function="step",
        confidence=round(_effect(ratio), 3),
        summary=f"all {len(ranks)} ranks slowed down together: {what} {ratio:.2f}x the job's own start",
        evidence={
            "metric": f"median {what}, last chunks vs first chunk",
            "baseline_ms": _ms(float(stragglers.nanmedian(per[:, last[0]], axis=0))),
            "now_ms": _ms(float(stragglers.nanmedian(per[:, last[-1]], axis=0))),
            "ratio": round(ratio, 3),
            "step_time_ratio": round(step_ratio, 3),
        },
        scope="job",
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


def diagnose(data: JobData, settings: Settings | None = None) -> Diagnosis:
    """Analyze one job's records; findings ranked by confidence (empty for a healthy job)."""
    s = settings or Settings()
    t0 = time.perf_counter()
    found: list[Finding] = []
    hang = hangs.find(data.heartbeats, s.hangs)
    sts = stragglers.find(data.steps, s.steps)
    sts += stragglers.shifted(data.steps, s.steps, exclude=[st.rank for st in sts])
    links = communication.find(data.functions, s.comm, data.ranks)
    waits = {c.rank: c for c in contention.find(data.functions, data.steps, s.contention)}
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
    found += _straggler_findings(sts, data, hosts, waits)
    found += [_comm_finding(link, hosts) for link in links]
    # A contended rank need not work longer itself: the threads that queue may be the collectives'.
    straggling = {st.rank for st in sts}
    found += [_contention_finding(c, hosts) for rank, c in waits.items() if rank not in straggling]
    found = _group_topology(found, data.ranks)
    if not found:
        jw = _job_wide(data, s)
        found = [jw] if jw else []
    found = sorted((f for f in found if f.confidence >= s.min_confidence), key=lambda f: -f.confidence)
    steps = data.steps["step"]
    analyzed = {
        "ranks": int(data.steps["rank"].nunique()) if not data.steps.empty else len(data.ranks),
        "steps": [int(steps.min()), int(steps.max())] if not steps.empty else [],
        "windows": int(data.functions["window"].nunique()) if not data.functions.empty else 0,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    return Diagnosis(job=data.job, findings=found, analyzed=analyzed)
