"""What the diagnosis says: findings with a cause, the culprits, a confidence and the evidence."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

Cause = Literal[
    "compute", "communication", "dataloader", "host_contention", "code_path", "hang", "job_wide", "failure"
]
CAUSES: tuple[Cause, ...] = get_args(Cause)
"""Stable cause names: part of the output contract (JSON, tickets, API)."""
LEVELS = ("nic", "host", "switch", "spine")
"""The topology levels a rank's ``rank`` record may name, smallest first (a switch: the leaf)."""


def ms(us: float) -> float:
    """Microseconds as milliseconds, for evidence."""
    return round(us / 1e3, 3)


def effect(ratio: float) -> float:
    """A confidence from an effect size: 0 for no deviation, ~0.74 at 1.2x, ~0.96 at 1.5x."""
    return 1.0 - math.exp(-max(ratio - 1.0, 0.0) / 0.15)


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    cause: Cause
    ranks: list[int]
    hosts: list[str]
    function: str
    """The function (operator, Python function, collective, ``step``) the evidence points at."""
    confidence: float
    """0-1: how sure the analysis is (effect size x persistence x how much of the excess it explains)."""
    summary: str
    """One sentence a person can act on."""
    evidence: dict[str, Any] = field(default_factory=dict)
    """Numbers a person can check: the culprit's value, the peer median, the ratio, windows flagged."""
    scope: str = "rank"
    """``rank``, ``link`` (the link between two ranks: ``ranks`` its two ends, neither slow on its
    other links), one of ``LEVELS`` or ``job``: what the culprits have in common."""

    def __post_init__(self) -> None:
        if self.cause not in CAUSES:
            raise ValueError(f"unknown cause {self.cause!r}; expected one of {CAUSES}")
        if not 0.0 <= self.confidence <= 1.0:
            raise ValueError(f"confidence must be in [0, 1], got {self.confidence}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Diagnosis:
    job: str
    findings: list[Finding]
    """Ranked: most confident first. Empty for a healthy job."""
    analyzed: dict[str, Any] = field(default_factory=dict)
    """What was looked at: ranks, steps, windows, seconds taken."""

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job, "findings": [f.to_dict() for f in self.findings], "analyzed": self.analyzed}
