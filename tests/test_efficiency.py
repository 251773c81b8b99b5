"""Where a job's time goes (``diagnosis.efficiency``): the step rows split, the windows split the rest."""

from __future__ import annotations

import pandas as pd
import pytest

from rankscope.diagnosis.efficiency import measure
from rankscope.wire.errors import NotFoundError


def _steps(rank: int, n: int = 100, dur: float = 100_000, data: float = 10_000, comm: float = 30_000) -> list:
    return [(rank, s, 1_000_000 + s * dur, dur, data, comm) for s in range(n)]


def test_steps_and_windows_split_each_ranks_time() -> None:
    steps = pd.DataFrame(
        _steps(0) + _steps(1, comm=50_000),
        columns=["rank", "step", "start_us", "dur_us", "data_us", "comm_us"],
    )
    windows = pd.DataFrame(
        [(0, {"compute": 0.45, "comm": 0.3, "data": 0.1, "idle": 0.15})] * 2, columns=["rank", "busy"]
    )
    ranks = pd.DataFrame([(0, "h0", "cpu"), (1, "h1", "cpu")], columns=["rank", "host", "device"])
    e = measure("j", steps, windows, ranks)
    r0, r1 = e.ranks
    assert (r0.data_wait, r0.comm_wait, r0.own) == pytest.approx((0.1, 0.3, 0.6))
    assert (r0.compute, r0.overhead, r0.windows) == (pytest.approx(0.45), pytest.approx(0.15), 2)
    assert r0.step_ms == pytest.approx(100) and r0.host == "h0"
    assert r1.comm_wait == pytest.approx(0.5) and r1.compute is None and r1.overhead is None
    assert e.shares["comm_wait"] == pytest.approx(0.4) and e.shares["compute"] == pytest.approx(0.45)
    assert e.wall_s == pytest.approx(10) and e.device_hours == pytest.approx(20 / 3600, abs=1e-4)
    assert e.idle_device_hours == pytest.approx(20 / 3600 * 0.55, abs=1e-4)
    assert any("1 of 2 ranks have no profiling window" in n for n in e.notes)
    assert any("CPU job" in n for n in e.notes)

    blind = measure("j", steps, windows.iloc[:0], ranks)
    assert blind.shares["compute"] is None and blind.idle_device_hours is None
    with pytest.raises(NotFoundError, match="no steps"):
        measure("j", steps.iloc[:0], windows, ranks)
