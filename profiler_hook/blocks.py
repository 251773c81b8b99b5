"""Always-on step rows, summed over blocks of consecutive steps: the hook's volume, bounded by time.

One row per step is ~70 bytes; at 10 ms a step that is 400 KB a minute per rank, 40 times the
volume a rank may ship always on. So a row holds the totals of a block of steps that lasts about
``block_s`` seconds. A block's length is a power of two and blocks end at multiples of it, so
every rank's rows cover the same steps: ranks of a synchronous job run at the same step time and
pick the same length (a rank changes it only when its blocks last under half or over twice
``block_s``, so a small difference in step time never splits the ranks). A block also ends early
when the step numbers jump, when it has lasted twice ``block_s`` (the steps slowed down: their rows
must not wait), and when the hook pauses or closes. Steps longer than ``block_s`` get a row each.
The store reads each row back as its steps, each with the block's mean values.

A block's CPU time, context switches, run-queue wait and garbage collection are the differences of
the thread's and process's counters from one block's end to the next — the sum of its steps' — read
once per block, not per step (~10 µs saved a step). Where the step numbers jump, the step after the jump is counted in
the block before it.

The run-queue wait outside collectives (a row's ``wait_us``, which own time leaves out) is read
exactly at the steps that read the wait (``collectives.WAIT_EVERY_NS``); a block counts as that wait
the read steps' share of the time outside collectives that the thread spent off the CPU. Where the
thread computes, off the CPU is waiting for one: on every healthy rank of a 3-D job, 8 ranks on 2
cores, the share was 1.00 (0.04-0.20 from step to step), and a rank blocking 60 ms a step in an
upload had its own (0.60). The share of the whole wait that fell inside collectives, which blocks
counted before, moves by 0.12 from step to step, and read at one step in 8 (the 3-D job's ~90
calls a step) it left a healthy rank's own time by chunk of steps 5.2% from its peers' on average
(a false straggler at 1.13x); the share of the time off the CPU, 1.9%.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from rankscope.wire.records import StepRow

OFF_POOL = 0.75
"""How much of what the read steps before it said each read step keeps (see ``StepBlocks._off``)."""

MAX_STEPS = 1 << 16
"""The longest block (at 30 µs steps, 2 s)."""


class StepBlocks:
    """Sums finished steps into :class:`StepRow` blocks; the closed ones wait in ``rows``."""

    def __init__(
        self,
        block_s: float,
        usage: Callable[[], tuple[int, int, int, int] | None] = lambda: (0, 0, 0, 0),
        uncounted: Callable[[], int] = lambda: 0,
    ) -> None:
        self.block_s = block_s
        self._usage = usage
        """Cumulative CPU µs, involuntary context switches, run-queue wait µs and garbage-collection
        µs, read when a block ends (None: not readable now; the block gets none)."""
        self._uncounted = uncounted
        """The collectives launched since it was last called that the steps did not count (those
        launched from C++ outside the tracked paths), read when a block ends."""
        self._base = usage() or (0, 0, 0, 0)
        self.length = 1
        """Steps per block now: a power of two."""
        self.rows: list[StepRow] = []
        self._open: list[int] | None = None
        """step, start_us, dur, data, comm, n_coll, first-collective sum and count, n, and of the
        steps that read the run-queue wait: their wait inside collectives, in all, and how many;
        their wait outside collectives and their time outside collectives off the CPU."""
        self._wait_share = 0.0
        """The share of the run-queue wait that fell inside collectives, in the steps that read it
        of the last block that had any (where no step read its time off the CPU: see ``_off``)."""
        self._off = [0.0, 0.0]
        """The read steps' wait outside collectives and time off the CPU outside collectives (step
        time less the collectives' and the CPU time), each read step's weighed ``OFF_POOL`` less
        at each read step since: their ratio is the share of a block's time off the CPU outside
        collectives that is run-queue wait."""

    def add(
        self,
        step: int,
        start_us: int,
        dur_us: int,
        data_us: int,
        comm_us: int,
        n_coll: int,
        first_coll_us: int,
        comm_wait_us: int = 0,
        step_wait_us: int = -1,
        step_cpu_us: int = -1,
    ) -> bool:
        """Add one finished step (``comm_wait_us``: the training thread's run-queue wait inside its
        collectives, of ``step_wait_us`` in the whole step, and ``step_cpu_us`` its CPU time, where
        they were read; -1: not read); True if that closed a block."""
        b = self._open
        if b is not None and step != b[0] + b[8]:
            self.close()
            b = None
        if b is None:
            b = self._open = [step, start_us, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        b[2] += dur_us
        b[3] += data_us
        b[4] += comm_us
        b[5] += n_coll
        if first_coll_us >= 0:
            b[6] += first_coll_us
            b[7] += 1
        b[8] += 1
        if step_wait_us >= 0:
            b[9] += comm_wait_us
            b[10] += step_wait_us
            b[11] += 1
            if step_cpu_us >= 0:
                b[12] += max(0, step_wait_us - comm_wait_us)
                b[13] += max(0, dur_us - comm_us - step_cpu_us)
        if (step + 1) % self.length == 0 or b[2] >= 2e6 * self.block_s:
            self.close()
            return True
        return False

    def close(self) -> None:
        """End the open block (if any) here, and choose the length of the next ones."""
        b, self._open = self._open, None
        if b is None:
            return
        step, start, dur, data, comm, n_coll, first_sum, first_n, n, comm_wait, step_wait, reads, *off = b
        n_coll += self._uncounted()
        first = first_sum // first_n if first_n else -1
        if reads:
            self._wait_share = min(1.0, comm_wait / step_wait) if step_wait > 0 else 0.0
            keep = OFF_POOL**reads
            self._off = [keep * kept + read for kept, read in zip(self._off, off, strict=True)]
        base = self._base
        cpu, nivcsw, wait, collected = self._base = self._usage() or base
        waited = wait - base[2]
        if self._off[1] > 0:  # outside collectives, at the read steps' share of the time off the CPU
            outside = min(waited, round(max(0, dur - comm - (cpu - base[0])) * self._off[0] / self._off[1]))
        else:
            outside = max(0, waited - round(waited * self._wait_share))
        self.rows.append(
            StepRow(
                step,
                start,
                dur,
                data,
                comm,
                n_coll,
                first,
                cpu - base[0],
                nivcsw - base[1],
                n,
                outside,
                collected - base[3],
            )
        )
        step_s = dur / n / 1e6
        if self.block_s <= 0:
            self.length = 1
        elif not self.block_s / 2 <= self.length * step_s <= 2 * self.block_s:
            fit = math.log2(self.block_s / max(step_s, 1e-9))
            self.length = 1 << min(max(round(fit), 0), MAX_STEPS.bit_length() - 1)

    def restart(self) -> None:
        """Count CPU and context switches from now (after a pause: not the paused time's)."""
        self._base = self._usage() or self._base

    def take(self) -> list[StepRow]:
        """The closed rows, handed over (the open block stays open)."""
        rows, self.rows = self.rows, []
        return rows
