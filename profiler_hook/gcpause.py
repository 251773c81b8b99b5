"""How long Python's garbage collector stopped the process: always on, two calls a collection.

A collection holds the GIL from start to end, so no Python runs meanwhile on any of the rank's
threads: a full (generation 2) collection in a process with torch traverses every object it holds
and can stop a step for 100 ms or more. Ranks collect at different steps (each counts its own
allocations), so a synchronous job waits at its next collective for whichever rank collects,
and a rank that collects more often or longer than its peers (a clean-up it calls itself, more
objects to traverse) is a straggler whose operators are no slower. Megatron-LM offers to turn the
automatic collector off and collect on all ranks at the same steps (``--manual-gc``) for this reason.

The clock sums the collections' durations from ``gc.callbacks``, which the interpreter calls at
each collection's start and end (~1 µs a collection, a few hundred a second at most).

It also keeps where the last long collection on the training thread ran (the function of the
job's code that triggered it, as a stack sample names it): the stack sampler's thread cannot take
a sample while a collection holds the GIL, and would take it after the collection, where the
training thread has moved on; a sample due during that collection counts there instead
(``watchdog.StackSampler.sample``).
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

LONG_NS = 1_000_000
"""A collection this long (a sampler's look-up is ~1 µs) has its site kept."""


class GcClock:
    """Nanoseconds of garbage collection since :meth:`install`, on any thread."""

    def __init__(self, thread: int | None = None) -> None:
        self.total_ns = 0
        self._start = 0
        self._thread = threading.get_ident() if thread is None else thread
        self.site: Callable[[FrameType | None], str] | None = None
        """Names the job's function a frame is in (set by the stack sampler)."""
        self.last: tuple[int, int, str] = (0, 0, "")
        """The last long collection on the training thread: start and end (``perf_counter_ns``),
        and its site."""

    def _on(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter_ns()
            return
        if not self._start:  # the end of a collection that started before install
            return
        end = time.perf_counter_ns()
        self.total_ns += end - self._start
        if end - self._start >= LONG_NS and self.site is not None and threading.get_ident() == self._thread:
            self.last = (self._start, end, self.site(sys._getframe(1)))
        self._start = 0

    def site_at(self, ns: int) -> str | None:
        """The site of the long collection that ran at ``ns`` (``perf_counter_ns``), if one did."""
        start, end, site = self.last
        return site if start <= ns <= end else None

    def install(self) -> None:
        gc.callbacks.append(self._on)

    def uninstall(self) -> None:
        if self._on in gc.callbacks:
            gc.callbacks.remove(self._on)

    def us(self) -> int:
        return self.total_ns // 1000
