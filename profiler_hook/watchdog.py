"""The heartbeat thread: says every few seconds how far the rank got, and where it is stuck.

It also polls the profiling-window schedule, every ``schedule.POLL_S``."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Callable

from wire.records import Heartbeat

from .collectives import CollectiveTracker
from .schedule import POLL_S

_STACK_FRAMES = 12


def main_stack(thread_id: int) -> str:
    """The Python stack of thread ``thread_id`` (innermost last), or '' if it is gone."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ""
    return "".join(traceback.format_stack(frame, limit=_STACK_FRAMES))


class Watchdog:
    def __init__(
        self,
        *,
        make: Callable[..., Heartbeat],
        submit: Callable[[Heartbeat], bool],
        progress: Callable[[], tuple[int, int]],
        tracker: CollectiveTracker,
        interval_s: float,
        stall_s: float,
        main_thread_id: int,
        tick: Callable[[], None] = lambda: None,
    ) -> None:
        self._make, self._submit, self._progress = make, submit, progress
        self._tracker = tracker
        self._interval_s, self._stall_s = interval_s, stall_s
        self._main = main_thread_id
        self._tick = tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rankscope-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> Heartbeat:
        step, last_progress_ns = self._progress()
        now = time.perf_counter_ns()
        last = max(last_progress_ns, self._tracker.last_exit_ns)
        age = (now - last) / 1e9
        call = self._tracker.oldest_inflight()
        stalled = age >= self._stall_s
        return self._make(
            step=step,
            progress_age_s=round(age, 3),
            coll_group=call.group if call else "",
            coll_op=call.op if call else "",
            coll_seq=call.seq if call else -1,
            coll_age_s=round((now - call.enter_ns) / 1e9, 3) if call else 0.0,
            last_seq=dict(self._tracker.last_seq),
            stack=main_stack(self._main) if stalled else "",
        )

    def _run(self) -> None:
        # The thread also polls the window schedule (``tick``), more often than it beats.
        last_beat = time.monotonic()
        while not self._stop.wait(min(POLL_S, self._interval_s)):
            with contextlib.suppress(Exception):  # a heartbeat is never worth a crash
                self._tick()
                if time.monotonic() - last_beat >= self._interval_s:
                    last_beat = time.monotonic()
                    self._submit(self.beat())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
