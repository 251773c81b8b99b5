"""NCCL collectives timed on the GPU (``profiler_hook.nccl``), through the seam c10d offers.

No GPU is at hand in CI, and only ProcessGroupNCCL takes a completion hook (gloo refuses one). So
the process groups here are stand-ins with the four methods of torch's ``ProcessGroup`` the timing
calls (``_has_hooks``, ``_enable_collectives_timing``, ``_register_on_completion_hook``,
``_wait_for_pending_works``; present in torch 2.8 through 2.15), and the completions are
``WorkInfo``-shaped objects with what c10d fills in (``op_type``, ``seq``, ``time_started``,
``time_finished``, ``active_duration`` as a ``timedelta``), called from a thread of their own as
c10d's hook thread calls them. A fake where the real part cannot run; ``benchmarks.gpu_check``
runs the real one on a GPU.
"""

from __future__ import annotations

import datetime as dt
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rankscope.profiler_hook import hook as hook_module
from rankscope.profiler_hook import nccl
from rankscope.profiler_hook.collectives import CollectiveTracker
from rankscope.wire.records import RankInfo, StepBatch, coverage_gaps, decode
from tests.hook.common import one_rank_hook
from tests.records import ListSink


class Group:
    """A process group as the timing sees one (see the module's docstring)."""

    def __init__(self, hooked: bool = False, timing: bool = True) -> None:
        self.hook: Any = (lambda info: None) if hooked else None
        self.timing, self.can_time, self.waited = False, timing, 0

    def _has_hooks(self) -> bool:
        return self.hook is not None

    def _enable_collectives_timing(self) -> None:
        if not self.can_time:
            raise AttributeError("'ProcessGroup' object has no attribute '_enable_collectives_timing'")
        self.timing = True

    def _register_on_completion_hook(self, hook: Any) -> None:
        if self.hook is not None:  # c10d's own checks
            raise RuntimeError("ProcessGroupNCCL OnCompletion hook already registered")
        if not self.timing:
            raise ValueError("ProcessGroupNCCL OnCompletion hook requires recording start and end events")
        self.hook = hook

    def _wait_for_pending_works(self) -> None:
        self.waited += 1

    def complete(self, ms: float, seq: int = 1) -> None:
        """One collective completes: c10d calls the hook on its own thread."""
        now = dt.datetime.now()
        info = SimpleNamespace(
            op_type="OpType.ALLREDUCE",
            seq=seq,
            time_started=now - dt.timedelta(milliseconds=ms),
            time_finished=now,
            active_duration=dt.timedelta(milliseconds=ms),
        )
        t = threading.Thread(target=self.hook, args=(info,))
        t.start()
        t.join()


@pytest.fixture
def settle_now(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nccl, "SETTLE_S", 0.0)


def _settled(groups: list[tuple[str, str, Group]], add: Any) -> nccl.NcclTiming:
    """A timing whose groups were seen, then scanned again ``SETTLE_STEPS`` steps later."""
    steps = [0]
    timing = nccl.NcclTiming(add, lambda: steps[0], lambda: groups)
    timing.scan()
    steps[0] = nccl.SETTLE_STEPS
    timing.scan()
    return timing


def test_a_group_is_timed_on_the_gpu_once_what_it_launched_before_has_settled(settle_now: None) -> None:
    """Timing goes on when the group is first seen; the hook is registered only after
    ``SETTLE_STEPS`` finished steps (a collective launched untimed would make c10d abort the group
    when it completes into the hook); each completion's GPU time lands in the next step's wait."""
    tracker, pg, steps = CollectiveTracker(active=True), Group(), [0]
    timing = nccl.NcclTiming(tracker.add_gpu, lambda: steps[0], lambda: [("world", "nccl", pg)])
    timing.scan()
    assert pg.timing and pg.hook is None
    assert timing.coverage() == ["group world (nccl): GPU time from a few steps on"]
    steps[0] = nccl.SETTLE_STEPS - 1
    timing.scan()
    assert pg.hook is None, "registered before the untimed collectives settled"
    steps[0] = nccl.SETTLE_STEPS
    timing.scan()
    assert pg.hook is not None
    assert timing.coverage() == ["group world (nccl): collectives timed on the GPU"]
    assert coverage_gaps("; ".join(timing.coverage())) == []

    tracker.take_step(0)
    pg.complete(3.0)
    pg.complete(1.5, seq=2)
    comm_ns, *_ = tracker.take_step(0)
    assert comm_ns == pytest.approx(4.5e6, rel=1e-3)
    assert tracker.take_step(0)[0] == 0, "each completion counts once"
    timing.close()
    assert pg.waited == 1, "close waits for the collectives still pending"
    pg.complete(2.0)
    assert tracker.take_step(0)[0] == 0, "after close the hook, which stays registered, adds nothing"


def test_the_hook_never_raises_into_c10d(settle_now: None) -> None:
    """c10d aborts every communicator of a group whose completion hook raises."""
    tracker, pg = CollectiveTracker(active=True), Group()
    timing = _settled([("world", "nccl", pg)], tracker.add_gpu)
    for bad in (None, SimpleNamespace(active_duration=None), SimpleNamespace()):
        pg.hook(bad)  # returns: nothing to assert but that it did
    assert tracker.take_step(0)[0] == 0
    timing.close()


def test_a_group_that_cannot_be_timed_is_a_gap_in_the_coverage(settle_now: None) -> None:
    groups = [("world", "nccl", Group(hooked=True)), ("tp", "cuda:nccl", Group(timing=False))]
    timing = _settled(groups, lambda ns: None)
    said = timing.coverage()
    assert said == [
        "group world (nccl): GPU time not tracked (another completion hook)",
        "group tp (cuda:nccl): GPU time not tracked (AttributeError: "
        "'ProcessGroup' object has no attribute '_enable_collectives_timing')",
    ]
    assert coverage_gaps("; ".join(said)) == said
    assert groups[0][2].hook is not None and groups[1][2].hook is None


def test_each_group_is_said_with_its_own_backend(settle_now: None) -> None:
    groups = [("world", "nccl", Group()), ("tp", "cpu:gloo,cuda:nccl", Group())]
    timing = _settled(groups, lambda ns: None)
    assert timing.coverage() == [
        "group world (nccl): collectives timed on the GPU",
        "group tp (cpu:gloo,cuda:nccl): collectives timed on the GPU",
    ]
    timing.close()


def test_a_second_hook_in_the_process_keeps_the_groups_timed(settle_now: None) -> None:
    """c10d takes one completion hook per group, for good: ours forwards to the hook attached now."""
    pg = Group()
    first, second = CollectiveTracker(active=True), CollectiveTracker(active=True)
    a = _settled([("world", "nccl", pg)], first.add_gpu)
    a.close()
    b = nccl.NcclTiming(second.add_gpu, lambda: 0, lambda: [("world", "nccl", pg)])
    b.scan()
    assert b.coverage() == ["group world (nccl): collectives timed on the GPU"]
    pg.complete(2.0)
    assert second.take_step(0)[0] == pytest.approx(2e6, rel=1e-3)
    assert first.take_step(0)[0] == 0
    b.close()


def test_the_hooks_step_rows_carry_the_gpu_time_of_the_nccl_collectives(
    settle_now: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a whole hook on a real (gloo) job: an NCCL group alongside is found at attach, its
    hook registered at a heartbeat once steps have passed, the rank record says so, and the
    collectives' GPU time is in the step rows (paused, none is)."""
    pg = Group()
    monkeypatch.setattr(nccl, "nccl_groups", lambda: [("dp", "nccl", pg)])
    monkeypatch.setattr(hook_module, "process_groups", lambda: [("world", "gloo"), ("dp", "nccl")])
    dist.init_process_group(
        "gloo",
        store=dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False),
        rank=0,
        world_size=1,
    )
    try:
        sink = ListSink()
        hook = one_rank_hook(sink, window_s=0, heartbeat_s=60, step_block_s=0)
        for _ in range(nccl.SETTLE_STEPS):
            with hook.step():
                torch.ones(4).sum()
        hook.watchdog.beat()  # a heartbeat scans the groups: the hook is registered
        assert pg.hook is not None
        with hook.step():
            pg.complete(7.0)
        hook.pause()
        pg.complete(5.0)
        hook.resume()
        with hook.step():
            pass
        hook.close(timeout=30)
    finally:
        dist.destroy_process_group()
    infos = [r for r in map(decode, sink.got) if isinstance(r, RankInfo)]
    assert "group dp (nccl): GPU time from a few steps on" in infos[0].coverage
    assert "group dp (nccl): collectives timed on the GPU" in infos[-1].coverage
    # Said once: a group timed on the GPU is not also "counted, not timed" (as on the H200).
    assert "groups world (gloo): collectives from C++ counted, not timed;" in infos[-1].coverage
    rows = [row for r in map(decode, sink.got) if isinstance(r, StepBatch) for row in r.rows]
    assert [row.comm_us >= 7000 for row in rows] == [False, False, True, False], rows
    assert pg.waited == 1
