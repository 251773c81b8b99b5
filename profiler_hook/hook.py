"""The in-rank hook: step accounting, profiling windows, and the threads that ship it all.

Usage (see README)::

    hook = profiler_hook.attach(job="my-run")
    for batch in hook.wrap_loader(loader):
        with hook.step():
            loss = model(batch).sum(); loss.backward(); opt.step()
    hook.close()

Every public method catches its own failures: the hook never raises into the training loop.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import resource
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any, NamedTuple, TypeVar

from rankscope.wire.records import (
    MAX_MESSAGE,
    Checkpoint,
    Exit,
    FunctionPattern,
    Heartbeat,
    RankInfo,
    StepBatch,
    WindowSummary,
    coverage_gaps,
    pipeline_role,
)

from . import cupti, ddp, exits, threadstates
from .blocks import StepBlocks
from .budget import WindowBudget
from .collectives import CollectiveTracker, mesh_coordinates, process_groups
from .config import Config, Identity
from .gcpause import GcClock
from .gpu import GpuSampler
from .nccl import NcclTiming
from .schedstat import ThreadWait, Waits, run_queue_wait, wait_pattern
from .schedule import Schedule
from .shipper import Shipper
from .sinks import NullSink, Sink, make_sink
from .watchdog import Watchdog, job_frame

log = logging.getLogger(__name__)
T = TypeVar("T")

SUMMARIZE_WAIT_S = 1.0
"""How long a window's first step waits for the last window's summarizer; past it, no window."""
SETTLE_S = 0.05
"""How long a window's start or end waits for the collectives' threads to drop what they hold of
the backward pass (``threadstates``): past it, the window does not start, or ends a step later."""
MAX_POSTPONED = 20
"""Steps a window's end waits for them at most: then it ends regardless."""
SUPPORTED_TORCH = ((2, 8), (2, 15))
"""The oldest and newest torch releases (major, minor) the hook is tested on (``./dev test``)."""
MAX_GROUPS_SAID = 8
"""Process groups the rank record names one by one (a 3D-parallel job has hundreds)."""


class Window(NamedTuple):
    """A profiling window while it is open."""

    first: int
    """The step it was planned for, its first: the window's number."""
    end: int
    """The step it is due to end before (later where collectives are still held: ``MAX_POSTPONED``)."""
    started_ns: int
    """When it started (``time.time_ns()``)."""


def _role(mesh: dict[str, int]) -> int:
    """The schedule's number for a rank's role: 1 + its pipeline coordinates (0: no pipeline)."""
    role = pipeline_role(mesh)
    return 1 + sum(c << (16 * i) for i, (_, c) in enumerate(role)) if role else 0


def _now_us() -> int:
    return time.time_ns() // 1000


def _usage(wait: ThreadWait, clock: int | None, collected: GcClock) -> tuple[int, int, int, int]:
    """CPU µs of the training thread (from its CPU-time ``clock``, readable from any thread; the
    calling thread's without one), involuntary context switches of the whole process (CPU
    contention shows in any of its threads: the collectives' and data workers' too), the
    training thread's run-queue wait in µs (0 without schedstat), and the µs of garbage collection."""
    if clock is not None:
        cpu = time.clock_gettime_ns(clock) // 1000
    else:
        ru = resource.getrusage(resource.RUSAGE_THREAD)
        cpu = int((ru.ru_utime + ru.ru_stime) * 1e6)
    return cpu, resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw, wait() // 1000, collected.us()


def _cpu_clock(thread: int) -> int | None:
    """The CPU-time clock of thread ``thread`` (a ``threading.get_ident()``); None where the
    platform has none (macOS)."""
    try:
        return time.pthread_getcpuclockid(thread)
    except (AttributeError, OSError):
        return None


class Hook:
    """One per rank. Build it with :func:`profiler_hook.attach`."""

    def __init__(self, cfg: Config, ident: Identity, sink: Sink | None = None) -> None:
        self.cfg, self.ident = cfg, ident
        self.enabled = cfg.enable
        self.paused = False
        self.failures = 0
        """Hook calls that failed (and were logged): the training loop never sees them."""
        self._warm = threading.Event()
        self.step_num = -1
        self._finished = -1
        """The last step that ended (``step_num`` is the one begun): what heartbeats report."""
        self._error: BaseException | None = None
        """An exception that escaped a step (or the script), and no step has begun since."""
        self._training_thread = threading.get_ident()
        self._wait = ThreadWait()
        """The training thread's run-queue wait (see ``StepRow.wait_us``)."""
        self._cpu_clock = _cpu_clock(self._training_thread)
        self._gc = GcClock(self._training_thread)
        """Garbage collection's pauses (see ``StepRow.gc_us``)."""
        self._blocks = StepBlocks(cfg.step_block_s, self._step_usage, self._uncounted)
        self._last_flush = time.perf_counter()
        self._mark_ns = time.perf_counter_ns()
        self._epoch_offset_ns = time.time_ns() - self._mark_ns
        self._data_ns = 0
        self._prof: Any = None
        self._window: Window | None = None
        self._waits: Waits = {}
        """The threads' CPU wait at the window's start."""
        self._summarizers: list[threading.Thread] = []
        self._block_disturbed = False
        """Whether a window disturbed a step of the block open now (its rates are not compared)."""
        self.budget = WindowBudget(cfg.window_budget)
        self.schedule = Schedule(
            window_s=cfg.window_s,
            window_steps=cfg.window_steps,
            trigger_ratio=cfg.trigger_ratio,
            rank=ident.rank,
            world_size=ident.world_size,
            job=cfg.job,
            ready=self._warm,
            budget=self.budget,
        )
        clock = self._cpu_clock
        self.tracker = CollectiveTracker(
            thread_wait=self._wait,
            thread_cpu=time.thread_time_ns if clock is None else lambda: time.clock_gettime_ns(clock),
        )
        self.ddp = ddp.Watch(self.tracker)
        self.nccl = NcclTiming(self.tracker.add_gpu, lambda: self._finished + 1)
        if not self.enabled:
            self.shipper = Shipper(NullSink(), 1)
            self.shipper.close()  # nothing will ever be shipped: end its thread now
            self._wait.close()
            return
        self.shipper = Shipper(sink or make_sink(cfg, ident), cfg.queue_size, ident.pid)
        self._gc.install()
        _check_release()
        if cfg.window_s:
            self._warm_up()
            if cfg.with_stack:
                threadstates.install()
        self._calls = self._track_collectives() if cfg.patch_collectives else ""
        self._rank_info = RankInfo(
            # Stamped with the instant the first step's clock starts: steps start at or after it.
            **{**self._origin(), "time_us": (self._mark_ns + self._epoch_offset_ns) // 1000},
            local_rank=ident.local_rank,
            world_size=ident.world_size,
            pid=ident.pid,
            nic=ident.nic,
            switch=ident.switch,
            spine=ident.spine,
            backend=_backend(),
            device="cuda" if _cuda() else "cpu",
            attempt=ident.attempt,
            coverage=self.coverage(),
            mesh=mesh_coordinates(self.tracker.stages),
        )
        self.schedule.role = _role(self._rank_info.mesh)
        if gaps := coverage_gaps(self._rank_info.coverage):
            log.warning("rankscope: collective tracking: %s", "; ".join(gaps))
        self.shipper.submit(self._rank_info)
        self._gpu = GpuSampler(_cuda_device()) if _cuda() else None
        self.watchdog = Watchdog(
            make=self._heartbeat,
            submit=self.shipper.submit,
            # Paused, the hook watches no steps: it must not read its own pause as a stall.
            progress=lambda: (self._finished, time.perf_counter_ns() if self.paused else self._mark_ns),
            tracker=self.tracker,
            interval_s=cfg.heartbeat_s,
            stall_s=cfg.stall_s,
            main_thread_id=self._training_thread,
            tick=lambda: self.schedule.poll(self.step_num),
            collections=self._gc,
            sampling=lambda: not self.paused,
        )
        exits.closing_at_exit(self)
        self._blocks.restart()  # the first step's CPU time is not attach's own (imports, patching)

    @property
    def window(self) -> Window | None:
        """The profiling window open now, if one is."""
        return self._window

    def wait_summaries(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the windows taken so far to be summarized and handed
        to the shipper; whether they all were."""
        deadline = time.monotonic() + timeout
        for t in self._summarizers:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._summarizers)

    def _origin(self) -> dict[str, Any]:
        return {"job": self.cfg.job, "rank": self.ident.rank, "host": self.ident.host, "time_us": _now_us()}

    # --- the training loop's calls -------------------------------------------------------------

    def wrap_loader(self, loader: Iterable[T]) -> Iterator[T]:
        """Yield from ``loader``, timing how long each batch took to arrive (the step's data wait)."""
        it = iter(loader)
        while True:
            t0 = time.perf_counter_ns()
            try:
                item = next(it)
            except StopIteration:
                return
            self._data_ns += time.perf_counter_ns() - t0
            yield item

    def step(self, step: int | None = None) -> _Step:
        """Mark one training step (``with hook.step():``); ``step`` defaults to the previous step + 1."""
        return _Step(self, step)

    def begin_step(self, step: int | None = None) -> None:
        if not self.enabled or self.paused:
            return
        if self._error is not None:  # the script caught it and trains on
            self._error = None
        try:
            self.step_num = self.step_num + 1 if step is None else step
            self._maybe_start_window()
        except Exception as exc:
            self._fail("begin_step", exc)

    def end_step(self) -> None:
        if not self.enabled or self.paused:
            return
        try:
            now = time.perf_counter_ns()
            comm_ns, n_coll, first_ns, comm_wait_ns, step_wait_ns, step_cpu_ns = self.tracker.take_step(now)
            closed = self._blocks.add(
                self.step_num,
                (self._mark_ns + self._epoch_offset_ns) // 1000,
                (now - self._mark_ns) // 1000,
                self._data_ns // 1000,
                comm_ns // 1000,
                n_coll,
                (first_ns - self._mark_ns) // 1000 if first_ns >= 0 else -1,
                comm_wait_ns // 1000,
                step_wait_ns // 1000 if step_wait_ns >= 0 else -1,
                step_cpu_ns // 1000 if step_cpu_ns >= 0 else -1,
            )
            self._finished = self.step_num
            disturbed = self.budget.step(now - self._mark_ns)
            self.schedule.note_step(now - self._mark_ns, now - self._mark_ns - comm_ns, disturbed)
            self._block_disturbed |= disturbed
            if closed:
                row = self._blocks.rows[-1]
                if row.n_steps and not self._block_disturbed:
                    self.schedule.note_block(
                        (row.dur_us - row.comm_us) / row.n_steps, row.cpu_us / row.n_steps
                    )
                self._block_disturbed = False
            self._mark_ns, self._data_ns = now, 0
            self._maybe_stop_window()
            if closed and time.perf_counter() - self._last_flush >= self.cfg.flush_s:
                self._flush_steps()
        except Exception as exc:
            self._fail("end_step", exc)

    @contextlib.contextmanager
    def checkpoint(self, step: int | None = None, *, load: bool = False) -> Iterator[None]:
        """Time a checkpoint save (or, with ``load``, a load) around the training loop's own call::

            with hook.checkpoint():
                torch.save(state, path)

        ``step``: the step training would resume at from this checkpoint; by default, for a save
        the next one (``step_num + 1``), for a load -1 (unknown: the steps that follow tell).
        ``rankscope reliability`` reads these to measure the checkpoints' cost and interval; the
        work a restart redoes it measures from the step numbers, so a resumed job should number
        its steps on (``hook.step(step)``)."""
        t0 = time.time()
        try:
            yield
        finally:
            self.record_checkpoint(t0, step, load=load)

    def record_checkpoint(self, started: float, step: int | None = None, *, load: bool = False) -> None:
        """A checkpoint save (or load) that began at ``started`` (``time.time()``) and ended now:
        for a framework that saves on its own and says so afterwards (see :meth:`checkpoint`)."""
        if not self.enabled:
            return
        t0 = int(started * 1e9)
        try:
            self.shipper.submit(
                Checkpoint(
                    **self._origin(),
                    kind="load" if load else "save",
                    step=step if step is not None else -1 if load else self.step_num + 1,
                    start_us=t0 // 1000,
                    dur_us=(time.time_ns() - t0) // 1000,
                    attempt=self.ident.attempt,
                )
            )
        except Exception as exc:
            self._fail("checkpoint", exc)

    def add_data_wait(self, seconds: float) -> None:
        """Count ``seconds`` as the current step's wait for its batch, where the training loop fetches
        batches itself instead of through :meth:`wrap_loader` (the framework callbacks)."""
        if self.enabled and not self.paused and seconds > 0:
            self._data_ns += int(seconds * 1e9)

    def pause(self) -> None:
        """Stop measuring until :meth:`resume`: no step accounting, no windows (their clock stops
        too), no stack samples, collectives unwrapped and DDP's synchronizations untimed."""
        if not self.enabled or self.paused:
            return
        self.paused = True
        self._blocks.close()
        self.schedule.pause()
        if self._prof is not None:  # a window cut short is no window: its steps would not end it
            with contextlib.suppress(Exception):
                self._settled()
                self._prof.stop()
            self._prof, self._window, self.tracker.recording = None, None, None
            self.budget.stopped(lambda: True)
        with contextlib.suppress(Exception):
            self.tracker.unpatch()

    def resume(self) -> None:
        if not self.enabled or not self.paused:
            return
        try:
            if self.cfg.patch_collectives:
                self.tracker.patch()
            self.schedule.resume()
            self._mark_ns, self._data_ns = time.perf_counter_ns(), 0
            self._blocks.restart()
            self.tracker.take_step(self._mark_ns)  # what happened while paused belongs to no step
        except Exception as exc:
            self._fail("resume", exc)
        self.paused = False

    def close(self, timeout: float = 10.0) -> None:
        """Ship what is left and stop the hook's threads, within ``timeout`` seconds in all; what
        cannot be shipped by then is counted in ``shipper.dropped``. Safe to call twice."""
        if not self.enabled:
            return
        self.enabled = False
        deadline = time.monotonic() + timeout
        with exits.closing(self):
            try:
                self._blocks.close()  # the step rows first: what a restart's redone work is measured by
                self._flush_steps()
                if self._prof is not None:
                    self._settled()
                    self._prof.stop()
                    self._prof = None
                self.wait_summaries(max(0.0, deadline - time.monotonic()))
                self._wait.close()
                self.watchdog.close(max(1.0, deadline - time.monotonic()))
                self.shipper.submit(self.watchdog.beat())
                self.shipper.submit(self._exit())
                self.tracker.unpatch()
                self.ddp.stop()
                self.nccl.close()
                threadstates.uninstall()
                self._gc.uninstall()
            except Exception as exc:
                self._fail("close", exc)
            self.shipper.close(max(0.0, deadline - time.monotonic()))

    def failed(self, exc: BaseException) -> None:
        """``exc`` escaped a step, or the script (``sys.excepthook``): the rank's exit record says
        so unless a step finishes after it (the script caught it)."""
        self._error = exc

    def _exit(self) -> Exit:
        """How this process ends (see ``Exit``)."""
        exc, signum = self._error, exits.signalled()
        fields: dict[str, Any] = {"how": "signal" if signum else "close", "signal": signum}
        quiet = isinstance(exc, KeyboardInterrupt) or (isinstance(exc, SystemExit) and exc.code in (None, 0))
        if exc is not None and not quiet:
            kind = type(exc)
            module = "" if kind.__module__ == "builtins" else f"{kind.__module__}."
            fields.update(
                how="exception",
                error=f"{module}{kind.__qualname__}",
                message=str(exc)[:MAX_MESSAGE],
                frame=job_frame(exc.__traceback__),
            )
        return Exit(
            **self._origin(),
            step=self.step_num if exc is not None else self._finished,
            attempt=self._rank_info.attempt,
            gpu=self._gpu.faults() if self._gpu is not None else {},
            **fields,
        )

    def __enter__(self) -> Hook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ---------------------------------------------------------------------------

    def _fail(self, where: str, exc: BaseException) -> None:
        self.failures += 1
        log.warning("rankscope: %s failed (%s: %s); training continues", where, type(exc).__name__, exc)

    def _track_collectives(self) -> str:
        """Wrap the collectives and find every DDP model; what the wrapping covers (or why not)."""
        try:
            self.tracker.patch()
            calls = "torch.distributed calls (plain, FSDP, FSDP2, pipelining, DTensor): timed"
        except Exception as exc:  # a torch built without distributed, say: training goes on
            calls = f"torch.distributed calls: not tracked ({type(exc).__name__}: {exc})"
        if not self.ddp.start():
            calls += "; DDP: not tracked (unavailable)"
        self.nccl.scan()
        return calls

    def coverage(self) -> str:
        """What the always-on tracking times, counts or does not see: per DDP model, per process
        group, per backend; the parts with a gap say "not tracked", "untested" or "off (". From any
        thread: models and groups made later change it (see :meth:`_heartbeat`)."""
        if not self.cfg.patch_collectives:
            return "off (patch_collectives=False)"
        parts = [self._calls, *(self.ddp.coverage() or ["DDP: no model yet"])]
        groups = process_groups()
        unnumbered = self.tracker.unnumbered
        if self.tracker.active:
            # Timed on the GPU (said below) is more than counted: such a group is said once.
            numbered = [
                f"{name} ({backend})"
                for name, backend in groups
                if name not in unnumbered and name not in self.nccl.timed
            ]
            if numbered:
                more = len(numbered) - MAX_GROUPS_SAID
                said = ", ".join(numbered[:MAX_GROUPS_SAID]) + (f" and {more} more" if more > 0 else "")
                parts.append(f"groups {said}: collectives from C++ counted, not timed")
            parts += [
                f"group {name} ({backend}): not tracked (no sequence numbers: collectives from C++ uncounted)"
                for name, backend in groups
                if name in unnumbered
            ]
        parts += self.nccl.coverage()
        # A group may name a backend per device: "cpu:gloo,cuda:nccl".
        backends = {b.rsplit(":", 1)[-1] for _, backend in groups for b in backend.split(",")}
        parts += [
            f"backend {b}: untested (counts and waits as the CPU sees them)"
            for b in sorted(backends - {"gloo", "nccl"})
        ]
        return "; ".join(parts)

    def _heartbeat(self, **fields: Any) -> Heartbeat:
        """A heartbeat (on the watchdog's thread); first, a rank record again where what the
        tracking covers or the rank's place in a device mesh changed since the last (a model, a
        process group or a mesh made since), stamped
        as the first: the store keeps one record per start of a rank, the latest one sent."""
        with contextlib.suppress(Exception):
            if self.cfg.patch_collectives and not self.paused:
                self.nccl.scan()  # NCCL groups made since: their collectives' GPU time
            coverage, mesh = self.coverage(), mesh_coordinates(self.tracker.stages)
            if (coverage, mesh) != (self._rank_info.coverage, self._rank_info.mesh):
                self._rank_info = replace(self._rank_info, coverage=coverage, mesh=mesh)
                self.shipper.submit(self._rank_info)
                self.schedule.role = _role(mesh)
        gpu = self._gpu.sample() if self._gpu is not None else {}
        return Heartbeat(
            **self._origin(),
            dropped=self.shipper.dropped,
            windows=self.budget.windows,
            window_cost_us=self.budget.spent_ns // 1000,
            **fields,
            **gpu,
        )

    def _settled(self) -> bool:
        """Whether a window may start or stop now (``threadstates.settle``: no collective's thread
        can still drop a context of the backward pass), waiting up to ``SETTLE_S``."""
        return threadstates.settle(SETTLE_S, lambda: self.tracker.oldest_inflight() is None)

    def _step_usage(self) -> tuple[int, int, int, int] | None:
        """The training thread's counters, from any thread (a close at SIGTERM, or from the harness of
        a hung job, runs on another: its last block once got no CPU time nor run-queue wait, and
        its own time read 1.4x its peers' for want of the wait); None on another thread where the
        training thread's CPU clock cannot be read."""
        if self._cpu_clock is None and threading.get_ident() != self._training_thread:
            return None
        try:
            return _usage(self._wait, self._cpu_clock, self._gc)
        except OSError:  # the training thread has ended
            return None

    def _uncounted(self) -> int:
        """Collectives launched from C++ outside the tracked paths since the last block."""
        if not self.tracker.active:
            return 0
        try:
            return self.tracker.catch_up()
        except Exception as exc:
            self._fail("counting the collectives c10d numbered", exc)
            return 0

    def _flush_steps(self) -> None:
        if rows := self._blocks.take():
            self.shipper.submit(StepBatch(**self._origin(), rows=tuple(rows)))
        self._last_flush = time.perf_counter()

    def _warm_up(self) -> None:
        """Import what torch.profiler's first ``start()`` imports (``torch._inductor``: ~1.7 s of
        CPU) and, on a GPU, start CUPTI (:func:`cupti.start`: seconds) now, at attach, so that no
        step pays for either; the schedule plans no window until every
        rank's is done. Not on a thread of ours: importing ``torch._inductor`` there while the
        script imports ``torch._dynamo`` (``torch.optim`` does) failed the script with "cannot
        import name 'IndentedBuffer'" from the partly imported module."""
        # torch 2.13's kineto prints two lines to stderr at every profiler start and stop, at any
        # log level short of "none": a line per rank every few seconds in the job's logs. Quiet it
        # unless the user chose a level (this also hides kineto's own errors in this process).
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        try:
            import torch._inductor.config  # noqa: F401

            if _cuda():
                cupti.ask_teardown()
                cupti.start()
        except Exception as exc:  # the profiler will import it, or fail, on its own
            log.debug("rankscope: profiler warm-up: %s", exc)
        finally:
            self._warm.set()

    def _maybe_start_window(self) -> None:
        s = self.step_num
        if s != self.schedule.planned or self._prof is not None:
            return
        # The last window's summarizer must be done: torch's Python tracer hooks every thread at
        # start and unhooks each at stop, and reading one result while the next session starts
        # shares kineto's state. It takes tens of milliseconds, and windows are seconds apart.
        if not self.wait_summaries(SUMMARIZE_WAIT_S):
            log.warning("rankscope: the last window is still being summarized: window %d skipped", s)
            return
        if not self._settled():  # nothing is kept unless with_stack installed it
            log.warning("rankscope: collectives of the last backward pass still held: window %d skipped", s)
            return
        cfg = self.cfg
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _cuda() else [])
        # Read before the profiler starts: its window would hold our reads.
        self._waits = run_queue_wait()
        stacks = cfg.with_stack and self.schedule.stacks
        self._prof = profile(activities=activities, with_stack=stacks, record_shapes=False)
        with cupti.quiet():
            self._prof.start()
        self._window = Window(s, s + self.schedule.steps, time.time_ns())
        self.budget.start(stacks, self.schedule.recent)
        self.tracker.recording = []

    def _maybe_stop_window(self) -> None:
        if self._prof is None or self._window is None or self.step_num + 1 < self._window.end:
            return
        prof, (lo, hi, t0) = self._prof, self._window
        if not self._settled() and self.step_num + 1 < hi + MAX_POSTPONED:
            return  # the next step's end tries again
        hi = self.step_num + 1
        dur_ns = time.time_ns() - t0  # the steps' time, stop() not included
        prof.stop()
        waits = wait_pattern(self._waits, run_queue_wait())
        extra = [waits] if waits is not None else []
        calls, self.tracker.recording = self.tracker.recording or [], None
        self._prof, self._window = None, None
        origin = self._origin()
        # Reading the events takes tens of milliseconds: do it off the training thread.
        t = threading.Thread(
            target=self._summarize,
            args=(prof, calls, lo, hi, dur_ns, origin, extra),
            name="rankscope-summarize",
            daemon=True,
        )
        self._summarizers = [x for x in self._summarizers if x.is_alive()] + [t]
        t.start()
        self.budget.stopped(lambda: not t.is_alive())

    def _summarize(
        self,
        prof: Any,
        calls: list,
        lo: int,
        hi: int,
        dur_ns: int,
        origin: dict,
        extra: list[FunctionPattern],
    ) -> None:
        cpu = time.thread_time_ns()
        try:
            from .summarize import summarize

            functions, busy, n = summarize(
                prof.profiler.kineto_results,
                calls,
                dur_ns,
                self.cfg.max_functions,
                self._epoch_offset_ns,
            )
            self.shipper.submit(
                WindowSummary(
                    **origin,
                    window=lo,  # a window's number is its first step
                    step_lo=lo,
                    step_hi=hi,
                    dur_us=dur_ns // 1000,
                    busy=busy,
                    n_events=n,
                    functions=(*functions, *extra),
                )
            )
        except Exception as exc:
            self._fail("summarizing a profiling window", exc)
        finally:
            self.budget.add_cpu(time.thread_time_ns() - cpu)


class _Step:
    """``with hook.step():`` — a plain context manager: ``contextlib.contextmanager``'s generator
    costs ~4.5 µs a step, more than the rest of the always-on work."""

    __slots__ = ("hook", "step")

    def __init__(self, hook: Hook, step: int | None) -> None:
        self.hook, self.step = hook, step

    def __enter__(self) -> None:
        self.hook.begin_step(self.step)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self.hook.failed(exc)
        self.hook.end_step()


@functools.cache
def _check_release() -> None:
    """Say once, in one line, when this torch is outside the releases the hook is tested on: it
    keeps what it can (a window it cannot read is logged and skipped; the steps go on)."""
    import torch

    version = str(torch.__version__)
    try:
        release = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        release = ()
    lo, hi = SUPPORTED_TORCH
    if not lo <= release <= hi:
        log.warning(
            "rankscope: torch %s is outside the releases the hook is tested on (%d.%d to %d.%d): "
            "it keeps what it can",
            version,
            *lo,
            *hi,
        )


@functools.cache
def _cuda_device() -> int:
    import torch

    return int(torch.cuda.current_device())


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _backend() -> str:
    try:
        import torch.distributed as dist

        return str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else ""
    except Exception:
        return ""
