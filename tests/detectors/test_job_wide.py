"""``job_wide`` on hand-built jobs: every rank slower than the job's own start."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pandas as pd
import pytest

from rankscope.api.tickets import lost_rank_s
from rankscope.diagnosis import JobData, diagnose
from rankscope.diagnosis.detectors import job_wide
from tests.jobdata import only, sched_windows, synthetic

SETTINGS = job_wide.Settings()
T = 1_800_000_000_000_000


def test_job_wide_slowdown() -> None:
    data = synthetic(steps=3000, growth=2.0)  # ~25 s of steps, each rank's work (and CPU time) growing
    f = only(job_wide.find(data, SETTINGS))
    assert (f.cause, f.scope, f.ranks) == ("job_wide", "job", list(range(8)))
    assert f.evidence["ratio"] > 1.3 and f.evidence["cpu_time_ratio"] > 1.3
    assert "x the CPU time: more work per step, or slower cores" in f.summary
    # It held over the last two of six chunks of the 2,990 steps after the warm-up: the job time a
    # ticket says it lost (it was none, whatever the slowdown and however long it lasted).
    assert f.evidence["held_steps"] == 996
    assert lost_rank_s(f, 8) == pytest.approx(
        (f.evidence["now_ms"] - f.evidence["baseline_ms"]) / 1e3 * 996 * 8
    )
    # The same slowdown off the CPU (blocking I/O, say): the CPU time per step stayed as it was.
    steady = data.steps.assign(cpu_us=data.steps.groupby("rank")["cpu_us"].transform("first"))
    f = only(job_wide.find(replace(data, steps=steady), SETTINGS))
    assert f.cause == "job_wide" and f.evidence["cpu_time_ratio"] == pytest.approx(1.0, abs=0.01)
    assert "CPU time" not in f.summary


def test_a_job_wide_slowdown_with_every_ranks_cpu_wait_grown_is_put_down_to_external_load() -> None:
    """Other processes on every rank's cores: all ranks slow alike (no rank stands out), and the
    threads' run-queue wait per step grew with the step time."""
    data = synthetic(steps=3000, growth=2.0)
    first = sched_windows({}, base_ms=0.5, windows=1)
    later = sched_windows({}, base_ms=4.0, windows=3)
    later["window"] += 1
    data = replace(data, functions=pd.concat([first, later], ignore_index=True))
    f = only(job_wide.find(data, SETTINGS))
    assert (f.cause, f.scope) == ("job_wide", "job") and "external load" in f.summary
    assert f.evidence["cpu_wait_ms_per_step_last"] > f.evidence["cpu_wait_ms_per_step_first"]
    assert "CPU time" not in f.summary, "the wait explains it"
    assert "external load" not in only(job_wide.find(synthetic(steps=3000, growth=2.0), SETTINGS)).summary


def test_without_two_windows_the_training_threads_wait_in_the_steps_says_external_load() -> None:
    """The same, where fewer than two windows ran (a job whose windows wait for their budget): the
    training thread's run-queue wait outside collectives, in every step block, grew with the step
    time (by 0.8 of its growth here)."""
    data = synthetic(steps=3000, growth=2.0)
    start = data.steps.groupby("rank")["dur_us"].transform("first")
    waited = data.steps.assign(wait_us=(data.steps["dur_us"] - start).clip(lower=0) * 0.8)
    f = only(job_wide.find(replace(data, steps=waited), SETTINGS))
    assert (f.cause, f.scope) == ("job_wide", "job") and "external load" in f.summary
    assert f.evidence["cpu_wait_of"] == "training thread" and "training thread now waits" in f.summary
    assert f.evidence["cpu_wait_ms_per_step_last"] > f.evidence["cpu_wait_ms_per_step_first"]
    # A tenth of the growth is no external load: the job's own work grew.
    waited = data.steps.assign(wait_us=(data.steps["dur_us"] - start).clip(lower=0) * 0.1)
    assert "external load" not in only(job_wide.find(replace(data, steps=waited), SETTINGS)).summary


def test_a_jobs_first_seconds_are_no_baseline() -> None:
    """The same growth over the first 300 steps (~2 s): start-up, not a job-wide slowdown yet."""
    assert job_wide.find(synthetic(steps=300, growth=2.0), SETTINGS) == []


def test_a_first_step_that_holds_the_jobs_start_up_does_not_make_it_old_enough() -> None:
    """A job's first step holds its start-up (imports, the model, the process group: 15 s here),
    then 5 s of steps growing 2x: still too young for a baseline. With 25 s of steps, job-wide."""
    young = synthetic(steps=600, growth=2.0)
    first = young.steps["step"] == young.steps["step"].min()
    young = replace(young, steps=young.steps.assign(dur_us=young.steps["dur_us"].mask(first, 15_000_000)))
    assert job_wide.find(young, SETTINGS) == []
    old = synthetic(steps=3000, growth=2.0)
    assert only(job_wide.find(old, SETTINGS)).cause == "job_wide"


def test_it_runs_only_when_no_rank_stands_out() -> None:
    """The same job-wide growth with one rank slower still: the straggler is the finding, and the
    job-wide slowdown, which it explains in part, is not reported beside it."""
    data = synthetic(steps=3000, growth=2.0, slow={5: {"compute_us": 3000}})
    assert job_wide.find(data, SETTINGS)  # alone, it would say job-wide
    assert [(f.cause, f.ranks) for f in diagnose(data).findings] == [("compute", [5])]


def test_a_restarted_jobs_own_start_is_its_latest_attempts() -> None:
    """Every rank's steps take 4x as long since step 7,500: a slowdown of the job's own, unless its
    ranks started again there (a restart on other hosts, say), which makes the attempt's steps its
    own start: steady since, no finding."""
    data = synthetic(steps=9000, slow={r: {"compute_us": 15_000, "from": 7500} for r in range(8)})
    steps = data.steps.assign(start_us=T + data.steps["step"] * 10_000)
    ranks = data.ranks.assign(time_us=T)
    assert only(job_wide.find(replace(data, steps=steps, ranks=ranks), SETTINGS)).ranks == list(range(8))
    again = ranks.assign(time_us=T + 7500 * 10_000)
    assert job_wide.find(replace(data, steps=steps, ranks=again), SETTINGS) == []


def _paced(data: JobData, pace: Callable[[pd.Series], pd.Series]) -> JobData:
    """``data`` with every rank's step, own and CPU time scaled by ``pace(step)``."""
    k = pace(data.steps["step"])
    st = data.steps.assign(
        dur_us=data.steps["dur_us"] * k, comm_us=data.steps["comm_us"] * k, cpu_us=data.steps["cpu_us"] * k
    )
    return replace(data, steps=st)


def test_an_older_jobs_steps_are_measured_against_their_usual_pace_not_one_fast_stretch() -> None:
    """A job older than the steps the rule reads (4,000 of 3,000): the first chunk read is any
    stretch of its life. Its steps ran 1.4x faster for that one stretch (a 20-minute healthy
    job's did, its shared cores freed for 30 s), then as before: no slowdown. Slower by 1.5x for
    its last third, against the chunks before, it is one."""
    data = synthetic(steps=4000)
    # Steps of ~11 ms: the 3,000 read span the rule's 20 s.
    dip = _paced(data, lambda step: pd.Series(2.0, index=step.index).mask(step.between(1000, 1499), 2 / 1.4))
    assert job_wide.find(dip, SETTINGS) == []
    late = _paced(dip, lambda step: pd.Series(1.0, index=step.index).mask(step >= 3000, 1.5))
    f = only(job_wide.find(late, SETTINGS))
    assert f.evidence["ratio"] == pytest.approx(1.5, abs=0.05)
    assert "the 4 chunks of steps before" in f.summary
