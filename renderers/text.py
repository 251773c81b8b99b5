"""The readable (non-JSON) form of a diagnosis, for terminals."""

from __future__ import annotations

from typing import TextIO

from diagnosis import Diagnosis

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
    lines = [
        f"rankscope diagnosis of job {d.job}: {a.get('ranks', 0)} ranks, {span}, {a.get('windows', 0)} windows"
    ]
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
