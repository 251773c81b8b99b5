"""What the profiling windows cost a rank, measured, and whether the next one fits its budget.

A window costs what the training loop loses to it: the extra time of the steps it covers (the
profiler's start and stop, its recording, the Python tracer) and of the steps after it that its
summarizing slows, counted against the steps before it, plus the CPU time the summarizing took on
the rank's process (on a CPU job that time is taken from the steps; on a GPU job from the cores
the data loader and the other ranks share). The cost scales with the events a window records, not
with its steps: a 5-step window of a small pipeline-parallel job held ~88,000 events and cost
~1.9 s, one of a 2-rank DDP MLP ~2,500 and ~10-75 ms.

So windows are spaced by what they cost: the planner (rank 0) starts the next one only when the
job's windows so far, plus what the next is expected to cost, stay within ``share`` of the time
since the hook started (periodic, triggered, follow-up windows alike: a request waits until it
fits), and sizes it so that one window costs at most what one ``window_s`` interval buys. What a
window is expected to cost comes from the windows measured so far (per profiled step, with and
without Python stacks: a window that looks for a cause records them where one step with them costs
no more than an interval buys, and waits for room for them; else it records operators alone);
before any is measured, the first window profiles one step of a slow job (``PROBE_S``), records no
Python stacks and is assumed to cost ``FIRST_COST_RATIO`` times the steps it profiles.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable

AFTER_STEPS = 2
"""Steps after the summarizing ends that are still counted as the window's (its last effects)."""
FIRST_COST_S = 0.05
"""The least the first window is assumed to cost (at a 0.5% budget it comes 10 s after start-up at
the earliest)..."""
FIRST_COST_RATIO = 3.0
"""...and it is assumed to cost this many times the time of the steps it profiles: a step's events
grow with its operators, and stopping the profiler, summarizing them and the steps they disturb
cost up to ~3x the profiled steps' time on the jobs ``benchmarks.overhead.job`` runs."""
PROBE_S = 0.1
"""The first window profiles this many seconds of steps (at least one step, at most
``window_steps``): on a job of 250 ms steps one step, not five, before its cost is known."""
STACK_FACTOR = 6.0
"""A window with Python stacks is expected to cost this many times one without until one with
stacks is measured: the Python tracer's events cost most at the profiler's stop, on the training
thread. One step of a small pipeline-parallel job on 2 shared cores: 5,500 events and ~0.16 s
without stacks, 29,000 and ~1.45 s with them (9x; stop() 0.14-0.81 s, summarizing 0.3-0.4 s of
CPU); a 2-rank DDP MLP's five steps: 1,100 against 2,566 events, ~10 against 45-75 ms (4.5-7.5x)."""


class WindowBudget:
    """One per rank. The training thread calls :meth:`start`, :meth:`step` and :meth:`stopped`; the
    summarizer :meth:`add_cpu`; the planner :meth:`fit`."""

    def __init__(self, share: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.share = share
        self.windows = 0
        """Windows measured so far..."""
        self.spent_ns = 0
        """...and what they cost, in all."""
        self._clock = clock
        self._started = clock()
        self._paused_at: float | None = None
        self._steps = {False: 0, True: 0}
        self._cost = {False: 0, True: 0}
        """Per kind (with Python stacks or not): steps profiled and their windows' cost (ns)."""
        self._open: list | None = None
        """The window being measured: [baseline ns (None: no step before it), extra ns, steps
        profiled, with stacks, steps still counted after it (-1 while it is open)]."""
        self._done: Callable[[], bool] = lambda: True
        self._cpu_ns = 0

    @property
    def measuring(self) -> bool:
        """Whether a window's cost is still being measured (the planner waits for it)."""
        return self._open is not None

    # --- the training thread -------------------------------------------------------------------

    def start(self, stacks: bool, recent_ns: Iterable[int]) -> None:
        """A window starts at this step; ``recent_ns``: the durations of the steps before it. The
        last window, if still measured here (this rank summarizes slower than the planner), is
        counted with what it cost so far."""
        if self._open is not None:
            self._close(self._open)
        recent = list(recent_ns)
        self._open = [int(statistics.median(recent)) if recent else None, 0, 0, stacks, -1]
        self._cpu_ns = 0

    def stopped(self, summarized: Callable[[], bool]) -> None:
        """The window's last step ended; ``summarized`` says when its summary is made."""
        if self._open is not None:
            self._open[4] = AFTER_STEPS
            self._done = summarized

    def step(self, dur_ns: int) -> bool:
        """A step ended; whether a window disturbed it (a trigger must not count it)."""
        w = self._open
        if w is None:
            return False
        if w[0] is not None:
            w[1] += dur_ns - w[0]
        if w[4] < 0:  # still open
            w[2] += 1
        elif self._done():
            w[4] -= 1
            if w[4] < 0:
                self._close(w)
        return True

    def _close(self, w: list) -> None:
        cost = int(max(0, w[1]) + self._cpu_ns)
        self._steps[w[3]] += max(1, w[2])
        self._cost[w[3]] += cost
        self.spent_ns += cost
        self.windows += 1
        self._open = None

    def add_cpu(self, ns: int) -> None:
        """The summarizer's CPU time for the window being measured (from its thread, before it ends)."""
        self._cpu_ns += ns

    # --- the planner ---------------------------------------------------------------------------

    def pause(self) -> None:
        self._paused_at = self._clock()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._started += self._clock() - self._paused_at
            self._paused_at = None

    def step_cost_ns(self, stacks: bool, spent_ns: int = 0) -> float | None:
        """What one profiled step is expected to cost (None: no window measured yet). Another
        rank's larger cost so far (``spent_ns``, the most the planner heard of) scales this rank's
        alike."""
        steps, cost = self._steps, self._cost
        if steps[stacks]:
            per_step = cost[stacks] / steps[stacks]
        elif steps[not stacks]:
            other = cost[not stacks] / steps[not stacks]
            per_step = other * STACK_FACTOR if stacks else other / STACK_FACTOR
        else:
            return None
        if self.spent_ns > 0 and spent_ns > self.spent_ns:
            per_step *= spent_ns / self.spent_ns
        return max(per_step, 1.0)

    def affordable(self, stacks: bool, interval_s: float, spent_ns: int = 0) -> bool:
        """Whether one profiled step of this kind costs no more than one interval of ``interval_s``
        buys (False before any window is measured)."""
        per_step = self.step_cost_ns(stacks, spent_ns)
        return per_step is not None and per_step <= self.share * interval_s * 1e9

    def fit(self, stacks: bool, most: int, step_s: float, interval_s: float, spent_ns: int = 0) -> int:
        """How many steps (1 to ``most``) a window may profile now; 0: none fits yet.

        At most what one interval of ``interval_s`` buys at the measured cost per profiled step
        (before any window is measured, ``PROBE_S`` of steps of ``step_s``, once what is left buys
        them at ``FIRST_COST_RATIO``), and no more than what is left of the budget: ``share`` of
        the time since the start, less what the job's windows cost so far (``spent_ns``, the most
        any rank the planner heard of measured; at least this rank's). Another rank's larger cost
        scales this rank's per-step cost alike."""
        per_step = self.step_cost_ns(stacks, spent_ns)
        now = self._paused_at if self._paused_at is not None else self._clock()
        left = self.share * (now - self._started) * 1e9 - max(self.spent_ns, spent_ns)
        if per_step is None:
            n = max(1, min(most, math.floor(PROBE_S / max(step_s, 1e-9))))
            return n if left >= max(FIRST_COST_S, FIRST_COST_RATIO * n * step_s) * 1e9 else 0
        n = min(
            most, max(1, math.floor(self.share * interval_s * 1e9 / per_step)), math.floor(left / per_step)
        )
        return max(0, n)
