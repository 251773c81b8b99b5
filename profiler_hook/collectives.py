"""Always-on collective tracking: per-process-group sequence numbers, entry and exit times.

Like PyTorch's Flight Recorder, every collective a rank enters gets the next sequence number of
its process group; ranks of a healthy job enter the same sequence numbers in the same order, so
the first number a rank never entered names the rank a hang waits for. Unlike Flight Recorder
this state is always shipped (on heartbeats), not dumped only at the watchdog timeout.

Tracking wraps the public ``torch.distributed`` collective functions. Calls made from C++ (DDP's
reducer, FSDP) bypass these wrappers; they are still seen inside profiling windows.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
)


@dataclass(slots=True)
class CollectiveCall:
    group: str
    op: str
    seq: int
    nbytes: int
    enter_ns: int
    dur_ns: int = -1


def _nbytes(obj: Any) -> int:
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):
        return int(obj.element_size() * obj.numel())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _group_name(group: Any) -> str:
    if group is None:
        return "world"
    return str(getattr(group, "group_name", "") or id(group))


@dataclass(slots=True)
class CollectiveTracker:
    """Counts, sequences and times collectives; read by the step accounting and the watchdog."""

    last_seq: dict[str, int] = field(default_factory=dict)
    current: CollectiveCall | None = None
    last_exit_ns: int = 0
    # Per-step accumulators, reset by take_step().
    step_comm_ns: int = 0
    step_count: int = 0
    step_first_enter_ns: int = -1
    # Calls recorded while a profiling window is open.
    recording: list[CollectiveCall] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _originals: dict[str, Any] = field(default_factory=dict)

    def enter(self, group: str, op: str, nbytes: int) -> CollectiveCall:
        now = time.perf_counter_ns()
        with self._lock:
            seq = self.last_seq.get(group, 0) + 1
            self.last_seq[group] = seq
        call = CollectiveCall(group, op, seq, nbytes, now)
        self.current = call
        if self.step_first_enter_ns < 0:
            self.step_first_enter_ns = now
        return call

    def exit(self, call: CollectiveCall) -> None:
        now = time.perf_counter_ns()
        call.dur_ns = now - call.enter_ns
        self.current = None
        self.last_exit_ns = now
        self.step_comm_ns += call.dur_ns
        self.step_count += 1
        if self.recording is not None:
            self.recording.append(call)

    def take_step(self) -> tuple[int, int, int]:
        """(comm_ns, count, first_enter_ns) since the last call, then reset."""
        out = (self.step_comm_ns, self.step_count, self.step_first_enter_ns)
        self.step_comm_ns, self.step_count, self.step_first_enter_ns = 0, 0, -1
        return out

    def patch(self) -> None:
        """Wrap torch.distributed's collectives (idempotent)."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for op in COLLECTIVES:
            original = getattr(c10d, op, None)
            if original is None or op in self._originals:
                continue
            self._originals[op] = original
            wrapped = self._wrap(op, original)
            setattr(c10d, op, wrapped)
            if getattr(dist, op, None) is original:
                setattr(dist, op, wrapped)

    def unpatch(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for op, original in self._originals.items():
            setattr(c10d, op, original)
            setattr(dist, op, original)
        self._originals.clear()

    def _wrap(self, op: str, original: Any) -> Any:
        tracker = self

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                group = kwargs.get("group")
                call = tracker.enter(_group_name(group), op, _nbytes(args[0]) if args else 0)
            except Exception:  # tracking must never break the collective
                return original(*args, **kwargs)
            try:
                return original(*args, **kwargs)
            finally:
                # For async_op=True this times the launch; the wait shows in the next sync point.
                tracker.exit(call)

        wrapper.__rankscope_original__ = original  # type: ignore[attr-defined]
        return wrapper
