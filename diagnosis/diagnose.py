"""Records in, findings out: hangs, stragglers with their cause, topology, job-wide slowdowns."""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from . import functions, hangs, stragglers
from .data import JobData
from .findings import Diagnosis, Finding


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    steps: stragglers.Settings = field(default_factory=stragglers.Settings)
    hangs: hangs.HangSettings = field(default_factory=hangs.HangSettings)
    job_wide_ratio: float = 1.3
    """All ranks' step time grew by this factor from the first to the last chunks: job-wide."""
    min_confidence: float = 0.3
    """Findings below this confidence are not reported."""


def _ms(us: float) -> float:
    return round(us / 1e3, 3)


def _effect(ratio: float) -> float:
    """0 for no deviation, ~0.74 at 1.2x, ~0.96 at 1.5x."""
    return 1.0 - math.exp(-max(ratio - 1.0, 0.0) / 0.15)


def _classify(
    st: stragglers.Straggler, excess: list[functions.FunctionExcess]
) -> tuple[str, str, float, dict[str, Any]]:
    """(cause, function, share of the excess it explains, evidence) for one straggler."""
    total = max(st.excess_us, 1.0)
    data_excess = st.data_us - st.peer_data_us
    if data_excess >= 0.5 * total:
        fn = functions.top_of_kind(excess, "dataloader")
        ev: dict[str, Any] = {"data_wait_ms": _ms(st.data_us), "peer_data_wait_ms": _ms(st.peer_data_us)}
        return "dataloader", fn.name if fn else "DataLoader.__next__", data_excess / total, ev
    extra = functions.top_extra(excess)
    if extra is not None and extra.excess_us >= 0.3 * total:
        ev = {
            "stack": extra.stack,
            "calls_per_step": round(extra.rank_count, 2),
            "peer_calls_per_step": round(extra.peer_count, 2),
            "function_ms_per_step": _ms(extra.rank_us),
            "function_peer_ms_per_step": _ms(extra.peer_us),
        }
        return "code_path", extra.name, extra.excess_us / total, ev
    own_eff = st.cpu_us / max(st.own_us, 1.0)
    peer_eff = st.peer_cpu_us / max(st.peer_own_us, 1.0)
    if st.nivcsw >= 2 * st.peer_nivcsw + 5 and own_eff <= 0.8 * peer_eff:
        ev = {
            "involuntary_switches_per_step": st.nivcsw,
            "peer_involuntary_switches_per_step": st.peer_nivcsw,
            "cpu_share_of_own_time": round(own_eff, 3),
            "peer_cpu_share_of_own_time": round(peer_eff, 3),
        }
        return "host_contention", "(whole process)", 1.0, ev
    slower = functions.top_slower(excess)
    ev = {}
    if slower is not None:
        ev = {
            "function_ms_per_step": _ms(slower.rank_us),
            "function_peer_ms_per_step": _ms(slower.peer_us),
            "function_ratio": round(slower.rank_us / max(slower.peer_us, 1e-9), 3),
            "calls_per_step": round(slower.rank_count, 2),
        }
    compute_excess = (st.own_us - st.data_us) - (st.peer_own_us - st.peer_data_us)
    name = slower.name if slower else "compute (no profiling window covered it)"
    return "compute", name, compute_excess / total, ev


def _straggler_finding(st: stragglers.Straggler, data: JobData, hosts: dict[int, str]) -> Finding:
    peers = [int(r) for r in data.ranks["rank"] if int(r) != st.rank] or sorted(
        set(data.steps["rank"].astype(int)) - {st.rank}
    )
    excess = functions.compare(data.functions, st.rank, peers)
    cause, fn, explained, ev = _classify(st, excess)
    persistence = st.chunks_flagged / max(st.chunks, 1)
    confidence = round(_effect(st.ratio) * persistence * min(1.0, max(0.5, explained)), 3)
    host = hosts.get(st.rank, "")
    evidence = {
        "metric": "own time per step = step time - time waiting in collectives",
        "rank_value_ms": _ms(st.own_us),
        "peer_median_ms": _ms(st.peer_own_us),
        "ratio": round(st.ratio, 3),
        "chunks_flagged": f"{st.chunks_flagged}/{st.chunks}",
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


def _group_topology(found: list[Finding], ranks: pd.DataFrame) -> list[Finding]:
    """Culprits that make up a whole host (or switch) become one finding naming it."""
    for label in ("host", "switch"):
        if ranks.empty or label not in ranks or ranks[label].nunique() < 2:
            continue
        members = ranks.groupby(label)["rank"].apply(lambda s: sorted(int(r) for r in s)).to_dict()
        by_key: dict[tuple[str, str], list[Finding]] = defaultdict(list)
        label_of = dict(zip(ranks["rank"].astype(int), ranks[label].astype(str), strict=False))
        singles = [f for f in found if len(f.ranks) == 1 and f.scope == "rank"]
        for f in singles:
            by_key[(f.cause, label_of.get(f.ranks[0], ""))].append(f)
        for (cause, where), fs in by_key.items():
            if (
                not where
                or len(members.get(where, [])) < 2
                or sorted(f.ranks[0] for f in fs) != members[where]
            ):
                continue
            fn = Counter(f.function for f in fs).most_common(1)[0][0]
            merged = Finding(
                cause=cause,
                ranks=members[where],
                hosts=sorted({h for f in fs for h in f.hosts}),
                function=fn,
                confidence=round(sum(f.confidence for f in fs) / len(fs), 3),
                summary=f"{label} {where}: all its ranks {members[where]} are {cause} stragglers; look at the {label}",
                evidence={"per_rank": {f.ranks[0]: f.evidence for f in fs}},
                scope=label,
            )
            found = [f for f in found if f not in fs] + [merged]
    return found


def _job_wide(data: JobData, s: Settings) -> Finding | None:
    df = stragglers.prepare(data.steps, s.steps)
    if df.empty or df["chunk"].nunique() < 3:
        return None
    per = df.groupby(["chunk", "rank"])["dur_us"].median().unstack("rank")
    base = per.iloc[0]
    growth = [float((per.iloc[i] / base).median()) for i in (-2, -1)]
    ratio = min(growth)
    if ratio < s.job_wide_ratio:
        return None
    ranks = sorted(int(r) for r in per.columns)
    return Finding(
        cause="job_wide",
        ranks=ranks,
        hosts=sorted(set(data.hosts().values())),
        function="step",
        confidence=round(_effect(ratio), 3),
        summary=f"all {len(ranks)} ranks slowed down together: step time {ratio:.2f}x the job's own start",
        evidence={
            "metric": "median step time, last chunks vs first chunk",
            "baseline_ms": _ms(float(base.median())),
            "now_ms": _ms(float(per.iloc[-1].median())),
            "ratio": round(ratio, 3),
        },
        scope="job",
    )


def _hang_finding(h: hangs.Hang, hosts: dict[int, str]) -> Finding:
    stack = next(iter(h.stacks.values()), "")
    frames = [ln.strip() for ln in stack.splitlines() if ln.strip().startswith("File ")]
    where = frames[-1] if frames else (f"collective #{h.seq} ({h.group})" if h.seq >= 0 else "unknown")
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
    hosts = data.hosts()
    found: list[Finding] = []
    hang = hangs.find(data.heartbeats, s.hangs)
    if hang is not None:
        found.append(_hang_finding(hang, hosts))
    found += [_straggler_finding(st, data, hosts) for st in stragglers.find(data.steps, s.steps)]
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
