"""How long Python's garbage collector stopped the process: always on, two calls a collection.

A collection holds the GIL from start to end, so no Python runs meanwhile on any of the rank's
threads: a full (generation 2) collection in a process with torch traverses every object it holds
and can stop a step for 100 ms or more. Ranks collect at different steps (each counts its own
allocations), so a synchronous job waits at its next collective for whichever rank collects,
and a rank that collects more often or longer than its peers (a clean-up it calls itself, more
objects to traverse) is a straggler whose operators are no slower. ByteDance's study of
stragglers in its training clusters names such pauses as one cause; Megatron-LM disables the
automatic collector and collects on all ranks at once (``--manual-gc``) for the same reason.

The clock sums the collections' durations from ``gc.callbacks``, which the interpreter calls at
each collection's start and end (~1 µs a collection, a few hundred a second at most).
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcClock:
    """Nanoseconds of garbage collection since :meth:`install`, on any thread."""

    def __init__(self) -> None:
        self.total_ns = 0
        self._start = 0

    def _on(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter_ns()
        elif self._start:  # "stop" of a collection that started after install
            self.total_ns += time.perf_counter_ns() - self._start
            self._start = 0

    def install(self) -> None:
        gc.callbacks.append(self._on)

    def uninstall(self) -> None:
        if self._on in gc.callbacks:
            gc.callbacks.remove(self._on)

    def us(self) -> int:
        return self.total_ns // 1000
