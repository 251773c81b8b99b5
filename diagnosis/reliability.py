"""Job reliability at scale: MTTF, the effective training time ratio (ETTR) and the checkpoint
interval that maximizes it — the model of Meta's "Revisiting Reliability in Large-Scale ML Research
Clusters" (arXiv 2410.21680).

A job on ``N`` nodes fails as a Poisson process of rate ``N·r_f`` (``r_f``: failures per node-day;
the paper measured 6.5 per 1,000 node-days). Every failure costs a restart (``u0``) and the work
done since the last checkpoint; every checkpoint blocks training for ``w_cp``. Then

    MTTF     = 1 / (N·r_f)
    E[ETTR] ≈ (1 − N·r_f·(u0 + Δt_cp/2)) / (1 + w_cp/Δt_cp)
    Δt_cp*   = √(2·w_cp / (N·r_f))            (the interval that maximizes E[ETTR])

The formula is first order in the failure rate. ``simulate_ettr`` runs the process itself (Monte
Carlo) and is the reference the tests hold it to: within 5% where MTTF ≥ 0.1 day and a failure
costs a small part of the MTTF (``N·r_f·(u0 + Δt_cp/2)`` ≤ 0.25), as at the optimal interval.
Beyond that the formula underestimates ETTR, badly once the loss per failure nears the MTTF.

Durations are seconds; rates are per node-day, as the paper gives them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from rankscope.wire.errors import UsageError

DAY_S = 86_400.0

FAILURES_PER_NODE_DAY = 6.5e-3
"""The paper's failure rate: 6.5 failures per 1,000 node-days (its two clusters' average)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobShape:
    """What a job's reliability depends on."""

    nodes: int
    restart_s: float
    """u0: from a failure until training runs again (detection, rescheduling, loading the checkpoint)."""
    interval_s: float
    """Δt_cp: training time between checkpoints."""
    write_s: float
    """w_cp: how long a checkpoint blocks training."""
    failures_per_node_day: float = FAILURES_PER_NODE_DAY

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise UsageError(f"JobShape.nodes must be >= 1, got {self.nodes}")
        if self.interval_s <= 0 or self.restart_s < 0 or self.write_s < 0:
            raise UsageError("JobShape needs interval_s > 0, restart_s >= 0 and write_s >= 0")
        if self.failures_per_node_day <= 0:
            raise UsageError("JobShape.failures_per_node_day must be > 0")

    @property
    def failure_rate_per_s(self) -> float:
        """N·r_f, per second."""
        return self.nodes * self.failures_per_node_day / DAY_S


def mttf_s(shape: JobShape) -> float:
    """Mean time to failure of the whole job: 1 / (N·r_f)."""
    return 1.0 / shape.failure_rate_per_s


def expected_ettr(shape: JobShape) -> float:
    """E[ETTR] ≈ (1 − N·r_f·(u0 + Δt_cp/2)) / (1 + w_cp/Δt_cp), clipped at 0."""
    lost = shape.failure_rate_per_s * (shape.restart_s + shape.interval_s / 2)
    return max(0.0, (1.0 - lost) / (1.0 + shape.write_s / shape.interval_s))


def optimal_interval_s(shape: JobShape) -> float:
    """The checkpoint interval that maximizes E[ETTR]: √(2·w_cp / (N·r_f))."""
    return math.sqrt(2.0 * shape.write_s / shape.failure_rate_per_s)


def simulate_ettr(shape: JobShape, train_s: float, seed: int = 0) -> float:
    """ETTR of one simulated job that must train ``train_s`` seconds: it trains ``interval_s``,
    writes a checkpoint (``write_s``), and so on; a failure (Poisson, anywhere, restarts included)
    loses the work since the last completed checkpoint and costs a restart. Productive time
    (``train_s``) over wall-clock time."""
    rng = random.Random(seed)
    rate = shape.failure_rate_per_s
    segment = shape.interval_s + shape.write_s
    wall = saved = 0.0
    while saved < train_s:
        t = rng.expovariate(rate)
        if t >= segment:
            wall += segment
            saved += shape.interval_s
            continue
        wall += t
        while (t := rng.expovariate(rate)) < shape.restart_s:  # failing again while restarting
            wall += t
        wall += shape.restart_s
    return train_s / wall
