"""The profiling windows' cost budget: measured per window, kept by the planner, on a simulated clock."""

from __future__ import annotations

import math

import pytest

from rankscope.profiler_hook.budget import (
    AFTER_STEPS,
    FIRST_COST_RATIO,
    FIRST_COST_S,
    STACK_FACTOR,
    WindowBudget,
)
from rankscope.profiler_hook.schedule import POLL_S, Schedule


def test_a_windows_cost_is_its_steps_extra_time_until_summarized_plus_the_summarizers_cpu() -> None:
    b = WindowBudget(0.005, clock=lambda: 0.0)
    for _ in range(3):
        assert not b.step(10_000_000)  # no window: nothing disturbed
    b.start(stacks=True, recent_ns=[10_000_000] * 20)
    assert b.step(30_000_000) and b.step(30_000_000)  # two profiled steps, 20 ms extra each
    summarized = [False]
    b.stopped(lambda: summarized[0])
    assert b.step(50_000_000)  # stop() and the summarizing: 40 ms extra
    b.add_cpu(7_000_000)
    summarized[0] = True
    for _ in range(AFTER_STEPS):
        assert b.measuring and b.step(12_000_000)
    assert b.step(10_000_000) and not b.measuring  # the last counted step
    assert not b.step(10_000_000)
    assert b.windows == 1
    assert b.spent_ns == 20_000_000 * 2 + 40_000_000 + 2_000_000 * AFTER_STEPS + 7_000_000
    assert b.step_cost_ns(True) == b.spent_ns / 2
    assert b.step_cost_ns(False) == pytest.approx(
        b.spent_ns / 2 / STACK_FACTOR
    )  # scaled from the stacked kind


def test_steps_that_ran_faster_during_a_window_cost_nothing_but_the_summarizers_cpu() -> None:
    b = WindowBudget(0.005, clock=lambda: 0.0)
    b.start(stacks=False, recent_ns=[10_000_000] * 20)
    b.step(8_000_000)
    b.stopped(lambda: True)
    b.add_cpu(1_000_000)
    for _ in range(AFTER_STEPS + 1):
        b.step(9_000_000)
    assert b.spent_ns == 1_000_000


def test_the_first_window_waits_until_the_budget_buys_three_times_the_steps_it_profiles() -> None:
    clock = [0.0]
    b = WindowBudget(0.005, clock=lambda: clock[0])
    clock[0] = FIRST_COST_S / 0.005 + 0.1  # 50 ms, the least a window is assumed to cost
    assert b.fit(False, 5, step_s=0.001, interval_s=30) == 5  # 5 ms of a fast job's steps
    assert b.fit(False, 5, step_s=0.004, interval_s=30) == 0  # 5 steps of 4 ms: 60 ms
    clock[0] = FIRST_COST_RATIO * 5 * 0.004 / 0.005 + 0.1
    assert b.fit(False, 5, step_s=0.004, interval_s=30) == 5
    assert b.fit(False, 5, step_s=0.25, interval_s=30) == 0  # a slow job's single step: 750 ms
    clock[0] = FIRST_COST_RATIO * 0.25 / 0.005 + 0.1
    assert b.fit(False, 5, step_s=0.25, interval_s=30) == 1


def test_a_window_profiles_what_is_left_of_the_budget_and_what_one_interval_buys_at_most() -> None:
    clock = [0.0]
    b = WindowBudget(0.01, clock=lambda: clock[0])
    b.start(stacks=False, recent_ns=[10_000_000])
    b.step(30_000_000)  # one profiled step: 20 ms
    b.stopped(lambda: True)
    for _ in range(AFTER_STEPS + 1):
        b.step(10_000_000)
    assert b.step_cost_ns(False) == 20_000_000 and b.step_cost_ns(True) == 20_000_000 * STACK_FACTOR
    clock[0] = 6.0  # 1% of 6 s: 60 ms, 20 of them spent
    assert b.fit(False, 5, 0.01, interval_s=30) == 2
    assert b.fit(True, 5, 0.01, interval_s=30) == 0  # 200 ms a step with Python stacks: none fits
    assert b.fit(False, 5, 0.01, interval_s=30, spent_ns=40_000_000) == 0  # another rank's 40 ms
    clock[0] = 100.0
    assert b.fit(False, 5, 0.01, interval_s=30) == 5
    assert b.fit(False, 5, 0.01, interval_s=3) == 1  # 1% of a 3 s interval: 30 ms, one step
    assert b.fit(True, 5, 0.01, interval_s=3) == 1  # one step, even where it costs more


def _run(
    seconds: float, step_ms: float, extra_ms: float, share: float, slower_from_s: float = 1e9
) -> tuple[Schedule, WindowBudget, float, list[tuple[float, bool]]]:
    """One rank's job on a simulated clock, driven as the hook drives it: a profiled step takes
    ``extra_ms`` longer, and so does the step after the window (its stop and summarizing); from
    ``slower_from_s`` on every step takes twice as long (a slowdown that triggers). Returns the
    schedule, the budget, the job's extra time from windows, and the windows taken (when, with
    Python stacks or not). A window with stacks costs ``STACK_FACTOR`` times more a step."""
    clock = [0.0]
    budget = WindowBudget(share, clock=lambda: clock[0])
    s = Schedule(window_s=30, window_steps=5, trigger_ratio=1.2, rank=0, world_size=1, job="j",
                 clock=lambda: clock[0], budget=budget)  # fmt: skip
    step, left, extra_total, next_poll, taken = 0, -1, 0.0, 0.0, []
    while clock[0] < seconds:
        if clock[0] >= next_poll:
            s.poll(step)
            next_poll += POLL_S
        if step == s.planned:
            budget.start(s.stacks, s.recent)
            left = s.steps
            taken.append((clock[0], s.stacks))
        base = step_ms * (2 if clock[0] >= slower_from_s else 1)
        extra = extra_ms * (STACK_FACTOR if s.stacks else 1.0) if left >= 0 else 0.0
        dur_ns = int((base + extra) * 1e6)
        disturbed = budget.step(dur_ns)
        s.note_step(dur_ns, disturbed=disturbed)
        if left > 0:
            left -= 1
            if left == 0:
                budget.stopped(lambda: True)
        elif left == 0:
            left = -1
        extra_total += extra / 1e3
        clock[0] += dur_ns / 1e9
        step += 1
    return s, budget, extra_total, taken


@pytest.mark.parametrize("extra_ms", [2.0, 60.0, 400.0])
def test_windows_stay_within_the_budget_however_much_they_cost(extra_ms: float) -> None:
    """A cheap window (2 ms a profiled step) leaves windows at their interval; an expensive one
    (400 ms a step: a pipeline-parallel job's) gets fewer and single-step windows."""
    seconds = 600.0
    s, budget, extra_s, taken = _run(seconds, step_ms=50.0, extra_ms=extra_ms, share=0.005)
    assert extra_s <= 0.005 * seconds
    assert budget.spent_ns / 1e9 == pytest.approx(extra_s, rel=0.05)  # what was measured is what it cost
    assert taken and budget.windows >= len(taken) - 1
    if extra_ms == 2.0:
        assert len(taken) >= seconds / 30 - 1 and s.steps == 5
    if extra_ms == 400.0:
        assert s.steps == 1 and len(taken) <= 0.005 * seconds / 0.8 + 1
        assert not any(stacks for _, stacks in taken)  # 2.4 s a step with stacks: more than 30 s buys


def test_a_slowdown_is_profiled_as_soon_as_the_budget_allows_and_no_window_triggers_another() -> None:
    """A trigger's request waits for the budget, not dropped; windows' own slow steps trigger
    nothing: with windows of 400 ms a step and no slowdown, no window is a triggered one."""
    s, *_ = _run(600.0, step_ms=50.0, extra_ms=400.0, share=0.005)
    assert s.requests_read == 0 and s._last_trigger == -math.inf
    s, _, extra_s, _ = _run(600.0, step_ms=50.0, extra_ms=400.0, share=0.005, slower_from_s=200)
    assert s._last_trigger > 200 and not s._pending  # asked for at ~203 s, served once affordable
    assert extra_s <= 0.005 * 600


def test_a_slowdown_waits_for_room_for_python_stacks_where_a_step_with_them_fits_an_interval() -> None:
    """60 ms a profiled step with stacks: 30 s of a 0.5% budget buy 150 ms, so the windows a
    slowdown asks for wait for room for stacks rather than spend it without them."""
    _, _, extra_s, taken = _run(600.0, step_ms=50.0, extra_ms=10.0, share=0.005, slower_from_s=200)
    after = [stacks for when, stacks in taken if when > 200]
    assert after[: 1 + 2] == [True] * 3  # the triggered window and its follow-ups
    assert not taken[0][1]  # the first measures what a window costs
    assert extra_s <= 0.005 * 600


def test_the_planner_holds_the_job_to_the_rank_whose_windows_cost_most() -> None:
    """Rank 0 plans for every rank: the windows' cost it keeps within the budget is the most any
    sampled rank measured, published with its step rates through the job's store."""
    import torch.distributed

    store, clock = torch.distributed.HashStore(), [0.0]
    budgets = [WindowBudget(0.005, clock=lambda: clock[0]) for _ in range(2)]
    planner, follower = (
        Schedule(window_s=30, window_steps=5, trigger_ratio=1.5, rank=r, world_size=2, job="j",
                 store=lambda: store, clock=lambda: clock[0], budget=budgets[r])
        for r in (0, 1)
    )  # fmt: skip
    for b, cpu_ns in zip(budgets, (10_000_000, 100_000_000), strict=True):  # one window each, 1 step
        b.start(stacks=False, recent_ns=[10_000_000])
        b.stopped(lambda: True)
        b.add_cpu(cpu_ns)
        for _ in range(AFTER_STEPS + 1):
            b.step(10_000_000)
    clock[0] = 30.0  # 0.15 s of budget: 0.1 spent by rank 1, and its window costs 0.1 a step
    for step in (100, 200):
        for s in (follower, planner):
            s.note_block(1000.0, 1000.0)
            s.poll(step)
    assert planner.spent_ns == 100_000_000 and planner.plans == 0
    clock[0] = 45.0  # 0.225 s: one step fits
    planner.poll(300)
    follower.poll(301)  # reads the plan
    assert planner.plans == follower.plans == 1 and planner.steps == follower.steps == 1
    clock[0] = 30.0  # rank 0's own cost alone would have fit five steps at 30 s
    assert budgets[0].fit(False, 5, 0.01, 30) == 5
