"""The heartbeat thread: says every few seconds how far the rank got, and where it is stuck.

Every ``schedule.POLL_S`` it also polls the profiling-window schedule and samples which function of
the job's own code the training thread is in (:class:`StackSampler`): windows profile 5 steps in
30 s, and a stall every 20th batch falls between them three times in four; the samples, shipped with
each heartbeat, still see where the rank's time goes. Each heartbeat also carries the rank's network
sends per link since the last (:mod:`.netstat`): a slow NIC is measured over every second of the
job, not over a window's five steps of it, whose few megabytes the kernel's millisecond clock can
barely time.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from types import CodeType, FrameType, TracebackType

from rankscope.wire.records import Heartbeat, sample_key

from .collectives import CollectiveTracker
from .gcpause import GcClock
from .netstat import LinkMeter
from .schedule import POLL_S
from .summarize import library_dirs, library_frame

_STACK_FRAMES = 12
SAMPLE_SWITCH_S = 0.0002
"""A stack sample needs the GIL: where the training thread holds it, in Python code or in an
operator called from it, the sample waits until the thread lets it go, up to the interpreter's
switch interval (5 ms by default), or until the thread enters a call that releases it (a
collective, a backward pass) and is sampled there. So a stretch of Python shorter than that, a
gradient audit of 3 ms a step, was all but never sampled: a loop of 3 ms of Python and 10 ms of
sleep had 0 of 195 samples in its Python (its time: 23%). For the last ``SAMPLE_LEAD_S`` before a
sample is due, the interval is this instead, and put back after it: 14-18% of them (on the 2
shared cores, with a fault suite running: the rest the sampling thread's own wait for a CPU).
Another thread that wants the GIL meanwhile takes turns as finely, 10 ms twice a second."""
SAMPLE_LEAD_S = 0.01


def main_stack(thread_id: int) -> str:
    """The Python stack of thread ``thread_id`` (innermost last), or '' if it is gone."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ""
    return "".join(traceback.format_stack(frame, limit=_STACK_FRAMES))


@functools.cache
def _path_prefixes() -> tuple[str, ...]:
    """The directories torch's profiler strips from a Python function's file, longest first. Read
    when a sampler is made, never first in :meth:`StackSampler.site`: that runs in a garbage
    collection's callback too, which can come in the middle of an import on the training thread,
    and an import there (this one's, or ``sysconfig``'s data) broke CPython's import lock
    (``KeyError`` in ``_ModuleLock.acquire``: DDP's start-up importing sympy failed so)."""
    try:
        from torch.profiler.python_tracer import _prefix_regex

        return tuple(_prefix_regex())
    except Exception:  # a torch without it: sys.path, as that function starts from
        return tuple(sorted({os.path.abspath(p) + os.sep for p in sys.path}, reverse=True))


def job_frame(tb: TracebackType | None) -> str:
    """The innermost frame of the job's own code in a traceback, named as a stack sample names it
    (``"train.py(40): load @57"``); "" where none is the job's."""
    namer = StackSampler(0)
    for frame, line in reversed(list(traceback.walk_tb(tb))):
        if name := namer._name(frame.f_code):
            return sample_key(name, line or 0)
    return ""


class StackSampler:
    """Counts, per sample, the innermost function of the job's own code on a thread's stack, and
    the line it is at (``wire.records.sample_key``).

    Functions are named as torch's profiler names Python functions (``"train.py(40): load"``: the
    file relative to its ``sys.path`` entry, the line its definition starts on), so samples and
    windows name a function alike; ``""`` counts samples with none of the job's code on the stack.
    The line tells apart where a loop written at module level, or in one long function, spends
    its time: there every rank's samples fall in the same function. A sample holds the GIL for
    about 1 µs (measured): a look-up per frame, from innermost out to the first of the job's code.
    """

    def __init__(self, thread_id: int, collections: GcClock | None = None) -> None:
        self._thread = thread_id
        self._names: dict[CodeType, str] = {}
        self._prefixes = _path_prefixes()
        library_dirs()  # read now, not first in a collection's callback (see _path_prefixes)
        self.counts: Counter[str] = Counter()
        self._collections = collections
        if collections is not None:
            collections.site = self.site

    def _name(self, code: CodeType) -> str:
        name = self._names.get(code)
        if name is None:
            if len(self._names) >= 65536:  # code made at run time (exec, compiled graphs) keeps coming
                self._names.clear()
            path = os.path.abspath(code.co_filename)
            path = next((path[len(p) :] for p in self._prefixes if path.startswith(p)), path)
            name = f"{path}({code.co_firstlineno}): {code.co_name}"
            name = self._names[code] = "" if library_frame(name) else name
        return name

    def site(self, frame: FrameType | None) -> str:
        """The sample key of the innermost frame of the job's code from ``frame`` out ("" if none)."""
        while frame is not None and not (name := self._name(frame.f_code)):
            frame = frame.f_back
        return sample_key(name, frame.f_lineno or 0) if frame is not None else ""

    def sample(self, due_ns: int = 0) -> None:
        """One sample of the thread, due at ``due_ns`` (``perf_counter_ns``; 0: now). One due while
        a garbage collection held the GIL, which this thread waited for, counts where it ran."""
        site = self._collections.site_at(due_ns) if self._collections is not None and due_ns else None
        if site is None:
            site = self.site(sys._current_frames().get(self._thread))
        self.counts[site] += 1

    def take(self) -> dict[str, int]:
        """The counts since the last ``take``."""
        counts, self.counts = self.counts, Counter()
        return dict(counts)


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
        collections: GcClock | None = None,
        sampling: Callable[[], bool] = lambda: True,
    ) -> None:
        self._make, self._submit, self._progress = make, submit, progress
        self._sampling = sampling
        """Whether to sample the training thread's stack now (not while the hook is paused)."""
        self._tracker = tracker
        self._interval_s, self._stall_s = interval_s, stall_s
        self._main = main_thread_id
        self._tick = tick
        self.sampler = StackSampler(main_thread_id, collections)
        self.links = LinkMeter()
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
        seqs = self._tracker.seqs()
        group, op, seq = (call.group, call.op, call.seq) if call else ("", "", -1)
        if call is not None and call.blocking:
            # The thread is inside it, the last it launched: its number is c10d's, where c10d counted
            # collectives launched from C++ since the last catch-up that the tracker numbered too low.
            seq = max(seq, seqs.get(group, 0))
        elif call is None and stalled:
            # No tracked call: a stalled rank waits in the last collective launched from C++ (a
            # functional collective's wait, say), the one c10d numbered past the tracker's count.
            entered = self._tracker.entered()
            ahead = [(g, n) for g, n in seqs.items() if n > entered.get(g, 0)]
            if ahead:
                (group, seq), op = max(ahead, key=lambda gn: gn[1]), "c10d"
        return self._make(
            step=step,
            progress_age_s=round(age, 3),
            coll_group=group,
            coll_op=op,
            coll_seq=seq,
            coll_peer=call.peer if call is not None else -1,
            coll_age_s=round((now - call.enter_ns) / 1e9 if call else age if seq >= 0 else 0.0, 3),
            last_seq=seqs,
            stack=main_stack(self._main) if stalled else "",
            samples=self.sampler.take(),
            sends=self.links.read(),
        )

    def _run(self) -> None:
        # The thread also polls the window schedule (``tick``), more often than it beats.
        last_beat = time.monotonic()
        # Jittered, so that samples do not fall at one phase of a loop whose period divides POLL_S.
        while True:
            wait_s = min(POLL_S, self._interval_s) * random.uniform(0.5, 1.5)
            due_ns = time.perf_counter_ns() + int(wait_s * 1e9)
            if self._stop.wait(max(0.0, wait_s - SAMPLE_LEAD_S)) or self._sample_at(due_ns):
                break  # the sample first: the tick may wait for a store
            with contextlib.suppress(Exception):  # a heartbeat is never worth a crash
                self._tick()
            with contextlib.suppress(Exception):
                if time.monotonic() - last_beat >= self._interval_s:
                    last_beat = time.monotonic()
                    self._submit(self.beat())

    def _sample_at(self, due_ns: int) -> bool:
        """Sample the training thread at ``due_ns`` with the switch interval lowered until then
        (``SAMPLE_SWITCH_S``); whether the watchdog was stopped meanwhile. Not while the hook is
        paused: a sample takes the GIL from the training thread, and more often meanwhile."""
        if not self._sampling():
            return self._stop.wait(max(0.0, (due_ns - time.perf_counter_ns()) / 1e9))
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, SAMPLE_SWITCH_S))
        try:
            if self._stop.wait(max(0.0, (due_ns - time.perf_counter_ns()) / 1e9)):
                return True
            with contextlib.suppress(Exception):
                if self._sampling():  # paused meanwhile: no sample
                    self.sampler.sample(due_ns)
        finally:
            sys.setswitchinterval(interval)
        return False

    def close(self, timeout: float = 1.0) -> None:
        """Stop the thread, waiting up to ``timeout`` seconds for it to end. It may be inside a
        call of the job's store (C++, the GIL released): a daemon thread that returns from one while
        the interpreter shuts down is ended by ``pthread_exit`` through C++ frames, which aborts
        the process ("terminate called without an active exception", SIGABRT)."""
        self._stop.set()
        self._thread.join(timeout)
