"""CPU contention of the rank's process: how long its threads waited for a CPU (Linux schedstat).

A noisy neighbour on a rank's cores (another job, a data-preprocessing daemon, a runaway logger)
need not show in the training thread at all: the scheduler lets a thread that wakes from a sleep
run at once, so compute keeps its pace while the threads doing the collectives' and the data
loader's work queue behind the intruder — and every peer then waits for this rank inside the
collectives. The kernel counts, per thread, the time it was runnable but waiting for a CPU
(``/proc/<pid>/task/<tid>/schedstat``, second field, ns). Summed over the process's threads and
compared across ranks on the same steps, it names the rank whose host or cores are contended.

Reading is ~10 µs per thread and happens only at a profiling window's start and end.

Example::

    before = run_queue_wait()
    ...  # the window's steps
    pattern = wait_pattern(before, run_queue_wait())
"""

from __future__ import annotations

import os
import threading

from rankscope.wire.records import WAIT_KIND, WAIT_PATTERN, FunctionPattern

Waits = dict[int, int]
"""Thread id -> ns it has spent runnable but waiting for a CPU."""


def run_queue_wait() -> Waits:
    """Run-queue wait of each of this process's threads (empty where the kernel has no schedstat)."""
    out: Waits = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                out[int(tid)] = int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile, or no schedstat
    return out


class ThreadWait:
    """The run-queue wait of one thread (ns so far; 0 where the kernel has no schedstat), readable
    from any thread: its file stays open and each read is one ``pread`` (~1 µs).

    The hook reads the training thread's where it enters and leaves a collective, and once per
    block of steps: the wait outside collectives is host contention, not the rank's own work."""

    def __init__(self, tid: int | None = None) -> None:
        tid = threading.get_native_id() if tid is None else tid
        self._lock = threading.Lock()  # no read of a closed (or reused) descriptor
        try:
            self._fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = -1

    def __call__(self) -> int:
        with self._lock:
            if self._fd < 0:
                return 0
            try:
                return int(os.pread(self._fd, 64, 0).split(maxsplit=2)[1])
            except (OSError, ValueError, IndexError):  # the thread has ended
                return 0

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def wait_pattern(before: Waits, after: Waits) -> FunctionPattern | None:
    """The window's CPU wait as one pattern: ``total_us`` over all threads, ``count`` threads.

    Threads started during the window count from zero; threads that ended are left out."""
    if not before or not after:
        return None
    wait_ns = sum(max(ns - before.get(tid, 0), 0) for tid, ns in after.items())
    total = round(wait_ns / 1e3, 1)
    mean = round(total / len(after), 2)
    return FunctionPattern(
        WAIT_KIND, WAIT_PATTERN, "", len(after), total, mean, mean, mean, mean, 0.0, 0.0, 0.0, 0
    )
