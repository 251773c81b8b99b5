"""The readable (non-JSON) form of a diagnosis, for terminals."""

from __future__ import annotations

from typing import TextIO

from rankscope.diagnosis import Diagnosis
from rankscope.diagnosis.efficiency import Efficiency
from rankscope.diagnosis.ettr import Attempt, FailingHost, FailureClass, Reliability
from rankscope.preflight.verdict import Report

_KEYS = (
    "rank_value_ms",
    "peer_median_ms",
    "ratio",
    "chunks_flagged",
    "held_s",
    "profiled_windows",
    "collective_wait_ms",
    "peer_collective_wait_ms",
    "data_wait_ms",
    "peer_data_wait_ms",
    "function_ms_per_step",
    "function_peer_ms_per_step",
    "operator",
    "operator_ms_per_step",
    "operator_peer_ms_per_step",
    "entered_through",
    "loader",
    "calls_per_step",
    "peer_calls_per_step",
    "stalled_for_s",
    "waiting_in",
)


_JOINERS = frozenset("\u200c\u200d")
"""Zero-width (non-)joiners: not printable by ``str.isprintable`` but parts of emoji and of words in
some scripts, and harmless to a terminal; kept."""


def printable(text: str) -> str:
    """``text`` safe to write to a terminal: each character ``str.isprintable`` refuses (escape and
    other control characters, line breaks, bidi overrides, lone surrogates…) shown as its Python
    escape, e.g. ``\\x1b``.

    Job ids, host and function names come from the training job: an ESC in one would otherwise
    reach the terminal raw (move the cursor, change colours, rewrite what was printed).
    """
    if text.isprintable():
        return text
    return "".join(
        ch if ch.isprintable() or ch in _JOINERS else ch.encode("unicode_escape").decode("ascii")
        for ch in text
    )


def format_diagnosis(d: Diagnosis) -> str:
    """The diagnosis as lines of text; every value from the job is :func:`printable`."""
    a = d.analyzed
    steps = a.get("steps") or []
    span = f"steps {steps[0]}-{steps[1]}" if steps else "no steps"
    cost = a.get("window_cost")
    lines = [
        f"rankscope diagnosis of job {d.job}: {a.get('ranks', 0)} ranks, {span}, {a.get('windows', 0)} windows"
        + (f" (their cost: {_cost(cost)} of a rank's run at most)" if cost is not None else "")
    ]
    if gaps := a.get("coverage_gaps"):
        lines.append(f"  not seen by the hook: {'; '.join(gaps)}")
    if lost := a.get("records_missing"):
        lines.append(f"  never stored (dropped by the hook or lost on the way): {lost}")
    if not d.findings and not steps:
        lines.append("  no findings: the job has no steps yet, so there is nothing to compare its ranks on")
    elif not d.findings:
        lines.append("  no findings: every rank keeps pace with its peers")
    for i, f in enumerate(d.findings, 1):
        where = f"rank{'s' if len(f.ranks) > 1 else ''} {', '.join(map(str, f.ranks))}"
        hosts = f" on {', '.join(f.hosts)}" if f.hosts else ""
        lines.append(
            f"  {i}. {f.cause.upper()}  {where}{hosts}  confidence {f.confidence:.2f}  [{f.function}]"
        )
        lines.append(f"     {f.summary}")
        ev = ", ".join(f"{k}={f.evidence[k]}" for k in _KEYS if k in f.evidence)
        if ev:
            lines.append(f"     evidence: {ev}")
    return "\n".join(printable(line) for line in lines)


def print_diagnosis(d: Diagnosis, file: TextIO | None = None) -> None:
    print(format_diagnosis(d), file=file, flush=True)


def _dur(s: float | None) -> str:
    if s is None:
        return "—"
    if s >= 86_400:
        return f"{s / 86_400:.1f} d"
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s < 1:
        return f"{1e3 * s:.0f} ms"
    return f"{s / 60:.1f} min" if s >= 120 else f"{s:.1f} s"


def format_reliability(r: Reliability) -> str:
    """A job's ETTR, lost time by cause, attempts and projection as lines of text."""
    lines = [
        f"rankscope reliability of job {r.job}: {r.steps} steps on {r.nodes} node{'s' * (r.nodes != 1)}, "
        f"{len(r.attempts)} attempt{'s' * (len(r.attempts) != 1)}, wall clock {_dur(r.wall_s)}",
        f"  ETTR {r.ettr:.3f}: productive {_dur(r.productive_s)} at {1e3 * r.baseline_step_s:.1f} ms a step",
    ]
    for cause, s in sorted(r.lost_s.items(), key=lambda kv: -kv[1]):
        if s > 0:
            lines.append(f"    lost to {cause:<10} {_dur(s):>9}  {100 * s / max(r.wall_s, 1e-9):5.1f}%")
    for a in r.attempts:
        lines.append(
            f"  attempt {a.number}: from {_dur(a.start_s)}, steps {a.first_step}-{a.last_step}"
            + (f"; {a.redone_steps} steps redone ({_dur(a.redo_s)})" if a.redone_steps else "")
            + (f"; hung {_dur(a.hang_s)}" if a.hang_s else "")
            + (f"; restart took {_dur(a.restart_s)}" if a.restart_s else "")
            + (_failed(a) if a.failure else "")
        )
    if r.failures:
        lines.append(
            "  failures by class: "
            + ", ".join(
                f"{k} {n}x, lost {_dur(r.lost_by_failure.get(k, 0.0))}"
                for k, n in sorted(r.failures.items(), key=lambda kv: -r.lost_by_failure.get(kv[0], 0.0))
            )
        )
    lines.append(
        f"  checkpoints: {r.saves} saved (blocking {_dur(r.write_s)}, every {_dur(r.interval_s)}), {r.loads} loaded"
    )
    lines.append(
        f"  at {1000 * r.failures_per_node_day:g} failures per 1,000 node-days: MTTF {_dur(r.mttf_s)}"
        + (f", expected ETTR {r.expected_ettr:.3f}" if r.expected_ettr is not None else "")
        + (f", best checkpoint interval {_dur(r.optimal_interval_s)}" if r.optimal_interval_s else "")
    )
    lines += [f"  note: {n}" for n in r.notes]
    return "\n".join(printable(line) for line in lines)


def _failed(a: Attempt) -> str:
    who = f"rank {a.failed_rank}" if a.failed_rank >= 0 else "no rank said why"
    return f"; failed: {who} [{a.failure}]" + (f" {a.error}" if a.error else "")


def pct(x: float | None) -> str:
    """A share as a percentage with one decimal; a dash for None (unknown)."""
    return "—" if x is None else f"{100 * x:.1f}%"


def format_efficiency(e: Efficiency) -> str:
    """Where a job's time goes, per rank, as lines of text."""
    idle = f"{e.idle_device_hours:.3f}" if e.idle_device_hours is not None else "—"
    s = e.shares
    lines = [
        f"rankscope efficiency of job {e.job}: {len(e.ranks)} ranks ({e.device}), wall clock {_dur(e.wall_s)}, "
        f"{e.device_hours:.3f} device-hours, {idle} of them not computing",
        f"  job: compute {pct(s['compute'])}, waiting for collectives {pct(s['comm_wait'])}, "
        f"waiting for data {pct(s['data_wait'])}, host overhead and idle {pct(s['overhead'])}",
        f"  {'rank':>5} {'host':<12} {'step ms':>8} {'compute':>8} {'comm':>7} {'data':>7} {'overhead':>9} windows  cost"
        + ("  GPU util  GPU MiB" if any(r.gpu_util is not None for r in e.ranks) else ""),
    ]
    for r in e.ranks:
        lines.append(
            f"  {r.rank:>5} {r.host[:12]:<12} {r.step_ms:>8.1f} {pct(r.compute):>8} {pct(r.comm_wait):>7} "
            f"{pct(r.data_wait):>7} {pct(r.overhead):>9} {r.windows:>7} {_cost(r.window_cost):>5}"
            + (f"  {r.gpu_util:>7.1f}% {r.gpu_mem_mb:>8.0f}" if r.gpu_util is not None else "")
        )
    lines += [f"  note: {n}" for n in e.notes]
    return "\n".join(printable(line) for line in lines)


def _cost(share: float | None) -> str:
    """What a rank's profiling windows cost, as a percentage of its run time with two decimals."""
    return "—" if share is None else f"{100 * share:.2f}%"


def format_fleet(fleet: list[Efficiency]) -> str:
    """Jobs, one line each, as ``rankscope efficiency --fleet`` orders them."""
    lines = [
        f"{'job':<32} {'ranks':>5} {'device-h':>9} {'not computing':>14} {'compute':>8} {'comm':>7} {'data':>7}"
    ]
    for e in fleet:
        s = e.shares
        idle = f"{e.idle_device_hours:.3f}" if e.idle_device_hours is not None else "—"
        lines.append(
            f"{e.job[:32]:<32} {len(e.ranks):>5} {e.device_hours:>9.3f} {idle:>14} {pct(s['compute']):>8} "
            f"{pct(s['comm_wait']):>7} {pct(s['data_wait']):>7}"
        )
    return "\n".join(printable(line) for line in lines)


def format_failing_hosts(hosts: list[FailingHost], classes: list[FailureClass]) -> str:
    """The hosts whose ranks failed attempts first, as ``rankscope reliability --fleet`` orders them,
    then the failures by class with their mean time to failure."""
    if not hosts:
        lines = ["rankscope reliability --fleet: no attempt in this store failed on a known host"]
    else:
        lines = [f"{'host':<24} {'failures (first to fail), by class':<44} jobs"]
    for h in hosts:
        by_class = ", ".join(f"{k} {n}x" for k, n in sorted(h.failures.items(), key=lambda kv: -kv[1]))
        lines.append(
            f"{h.host[:24]:<24} {by_class[:44]:<44} {len(h.jobs)}"
            + ("  LEMON: cordon it and check its GPUs" if h.lemon else "")
            + (f"  preflight {h.preflight}" if h.preflight else "")
        )
    if classes:
        lines.append(
            f"failures by class over {classes[0].node_days:.3g} node-days (MTTF of one node): "
            + ", ".join(f"{c.failure} {c.failures}x ({c.mttf_node_days:.3g} node-days)" for c in classes)
        )
    return "\n".join(printable(line) for line in lines)


def format_preflight(r: Report) -> str:
    """Every node's probes and the verdict, as lines of text."""
    lines = [
        f"rankscope preflight: {len(r.nodes)} nodes, all-reduce bus bandwidth {r.allreduce_busbw_gbps:.3g} GB/s, "
        f"{'FAILED: ' + ', '.join(sorted({c.node for c in r.failed})) if r.failed else 'all passed'}",
        f"  {'rank':>4} {'node':<16} {'device':<6} {'GFLOP/s':>9} {'memory GB/s':>12} {'send GB/s':>10}",
    ]
    for n in r.nodes:
        lines.append(
            f"  {n['rank']:>4} {str(n['node'])[:16]:<16} {n['device']:<6} {n['matmul_gflops']:>9.1f} "
            f"{n['memory_gbps']:>12.2f} {n['send_gbps']:>10.3f}"
        )
    lines += [f"  FAIL {c.node} ({c.check}): {c.message}" for c in r.failed]
    lines += [f"  note: {n}" for n in [*r.notes, *sorted({n["note"] for n in r.nodes if n.get("note")})]]
    return "\n".join(printable(line) for line in lines)
