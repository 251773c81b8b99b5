"""The reliability model (``diagnosis.reliability``) against a Monte Carlo run of the process it models."""

from __future__ import annotations

import math

import pytest

from rankscope.diagnosis.reliability import (
    DAY_S,
    JobShape,
    expected_ettr,
    mttf_s,
    optimal_interval_s,
    simulate_ettr,
)

MINUTE = 60.0


def test_mttf_shrinks_with_the_number_of_nodes() -> None:
    one = JobShape(nodes=1, restart_s=600, interval_s=3600, write_s=60)
    assert mttf_s(one) / DAY_S == pytest.approx(1000 / 6.5)
    assert mttf_s(JobShape(nodes=1000, restart_s=600, interval_s=3600, write_s=60)) / DAY_S == pytest.approx(
        1 / 6.5
    )


@pytest.mark.parametrize("nodes", [100, 1000, 1538])  # MTTF 1.5, 0.15 and 0.10 days
@pytest.mark.parametrize("restart_min", [5, 20])
@pytest.mark.parametrize("write_min", [0.5, 5])
@pytest.mark.parametrize("interval", ["optimal", "hourly"])
def test_the_expected_ettr_is_within_5_percent_of_the_simulated_where_the_paper_says(
    nodes: int, restart_min: float, write_min: float, interval: str
) -> None:
    shape = JobShape(nodes=nodes, restart_s=restart_min * MINUTE, interval_s=3600, write_s=write_min * MINUTE)
    if interval == "optimal":
        shape = JobShape(
            nodes=nodes,
            restart_s=shape.restart_s,
            interval_s=optimal_interval_s(shape),
            write_s=shape.write_s,
        )
    assert mttf_s(shape) >= 0.1 * DAY_S
    loss = shape.failure_rate_per_s * (shape.restart_s + shape.interval_s / 2)
    simulated = simulate_ettr(shape, train_s=400 * DAY_S, seed=nodes + restart_min)
    error = expected_ettr(shape) / simulated - 1
    if loss <= 0.25:
        assert abs(error) <= 0.05, (loss, expected_ettr(shape), simulated)
    else:  # a failure costs a large part of the MTTF: the first-order formula underestimates
        assert error < 0, (loss, expected_ettr(shape), simulated)


def test_the_optimal_interval_maximizes_the_simulated_ettr_too() -> None:
    base = JobShape(nodes=1000, restart_s=10 * MINUTE, interval_s=3600, write_s=2 * MINUTE)
    best = optimal_interval_s(base)
    assert best / MINUTE == pytest.approx(math.sqrt(2 * 2 / (1000 * 6.5e-3 / 1440)), rel=1e-9)

    def at(factor: float) -> float:
        shape = JobShape(nodes=1000, restart_s=base.restart_s, interval_s=best * factor, write_s=base.write_s)
        return simulate_ettr(shape, train_s=2000 * DAY_S, seed=7)

    assert at(1.0) > at(0.3) and at(1.0) > at(3.0)


def test_a_bad_shape_is_refused_with_the_field() -> None:
    with pytest.raises(ValueError, match="nodes"):
        JobShape(nodes=0, restart_s=1, interval_s=1, write_s=1)
    with pytest.raises(ValueError, match="interval_s"):
        JobShape(nodes=1, restart_s=1, interval_s=0, write_s=1)
