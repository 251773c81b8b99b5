"""``benchmarks.overhead.hook``: its analysis, and one short run of the real 2-rank DDP and pipeline jobs;
``benchmarks.overhead.calls``: one short run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.overhead import hook as hook_overhead


def test_a_windows_cost_is_its_busy_steps_and_the_two_after_less_the_usual_working_step() -> None:
    quiet = [(0.010, False)] * 9
    trace = [*quiet, (0.030, True), (0.020, True), (0.015, False), (0.012, False), *quiet]
    assert hook_overhead._window_costs(trace) == [pytest.approx(0.020 + 0.010 + 0.005 + 0.002)]
    assert hook_overhead._window_costs(quiet) == []


def test_the_interval_resamples_pairs_around_the_overall_ratio_per_step() -> None:
    on, off = [1.02, 1.00, 2.08, 0.99], [1.0, 1.0, 1.0, 1.0]
    on_steps, off_steps = [10, 10, 20, 10], [10] * 4  # the third working block went on for a window
    low, high = hook_overhead._bootstrap(on, on_steps, off, off_steps)
    assert low < (sum(on) / 50 / (sum(off) / 40) - 1) * 100 < high
    assert low >= -1.0 and high <= 4.0  # within the pairs' own extremes per step


def test_runs_pool_their_pairs_per_loop_shape_with_an_interval_for_the_median(tmp_path: Path) -> None:
    def run(name: str, ddp: list[list], manual: list[list]) -> str:
        rows = [{"loop": "ddp", "pair_s": ddp}, {"loop": "manual", "pair_s": manual}]
        (path := tmp_path / name).write_text(json.dumps({"rows": rows}))
        return str(path)

    # ddp's working blocks are 1%, 2%, 3% ... 6% slower per step than their paused partners.
    a = run("a.json", [[1.01, 10, 1.0, 10], [2.04, 20, 1.0, 10], [1.03, 10, 1.0, 10]], [[1.0, 10, 1.0, 10]])
    b = run("b.json", [[1.04, 10, 1.0, 10], [1.05, 10, 1.0, 10], [1.06, 10, 1.0, 10]], [[0.99, 10, 1.0, 10]])
    ddp, manual = hook_overhead.main(["--pool", a, b])["rows"]
    assert (ddp["loop"], ddp["pairs"], manual["pairs"]) == ("ddp", 6, 2)
    assert ddp["median_pair_pct"] == pytest.approx(3.5)
    low, high = ddp["median_ci95_pct"]
    assert 1.0 <= low <= 3.5 <= high <= 6.0
    assert ddp["overhead_pct"] == pytest.approx((7.23 / 70 / 0.1 - 1) * 100, abs=1e-3)
    assert manual["median_pair_pct"] == pytest.approx(-0.5)
    (tmp_path / "old.json").write_text(json.dumps({"rows": [{"loop": "ddp", "pair_pct": [1.0]}]}))
    with pytest.raises(SystemExit, match="no pair_s"):
        hook_overhead.main(["--pool", str(tmp_path / "old.json")])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_short_in_run_ab_of_a_ddp_and_a_pipeline_job_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    result = hook_overhead.main(
        ["--pairs", "2", "--block-s", "0.3", "--start-s", "1", "--volume-s", "6", "--loops", "ddp,pipeline",
         "--width", "256", "--json", str(out)]
    )  # fmt: skip
    assert json.loads(out.read_text()) == result
    row, pipeline = result["rows"]
    assert (pipeline["loop"], pipeline["pairs"], pipeline["dropped"]) == ("pipeline", 2, 0)
    assert pipeline["off_ms_per_step"] > 0 and pipeline["on_ms_per_step"] > 0
    assert row["loop"] == "ddp" and row["pairs"] == 2 and row["dropped"] == 0
    assert row["off_ms_per_step"] > 0 and row["on_ms_per_step"] > 0
    low, high = row["ci95_pct"]
    assert low <= row["overhead_pct"] <= high
    low, high = row["median_ci95_pct"]
    assert low <= row["median_pair_pct"] <= high and len(row["pair_s"]) == 2
    assert 0 < row["always_on_kb_per_min"] < 100  # step rows and heartbeats of the uninterrupted tail
    assert result["step_us"] > 0 and result["window_ms"] > 0 and result["stacked_window_ms"] > 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_per_call_benchmark_runs_every_mode_in_turn_and_reports_each_against_off(tmp_path: Path) -> None:
    """``benchmarks.overhead.calls``: a short run of its real 2-rank exchange."""
    from benchmarks.overhead import calls

    result = calls.main(["--rounds", "3", "--iters", "5", "--json", str(tmp_path / "calls.json")])
    assert [r["mode"] for r in result["rows"]] == ["off", "lean", "full"]
    assert all(len(v) == 3 and min(v) > 0 for v in result["us"].values())
    assert all(r["cpu_us_per_iteration"] > 0 for r in result["rows"])
    assert json.loads((tmp_path / "calls.json").read_text())["rows"] == result["rows"]
