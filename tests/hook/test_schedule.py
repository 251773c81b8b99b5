"""When windows run: the plan every rank agrees on through the job's store, triggers and
follow-ups."""

from __future__ import annotations

import gzip
import json
import math
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from rankscope.profiler_hook.config import Config
from rankscope.profiler_hook.schedule import LEAD_S, Schedule
from tests.hook.common import tcp_store

# Steps, windows and threads timed on the machine's clock: no other test beside them.
pytestmark = pytest.mark.alone


def _two_ranks(
    window_s: float, clock: list[float], ready: tuple[threading.Event | None, ...] = (None, None)
) -> tuple[Schedule, Schedule]:
    """Rank 0's and rank 1's schedules of one job, each with its own client of one real store."""
    master = tcp_store()
    return tuple(  # type: ignore[return-value]
        Schedule(
            window_s=window_s,
            window_steps=5,
            trigger_ratio=1.5,
            rank=rank,
            world_size=2,
            job="j",
            store=lambda: torch.distributed.TCPStore("127.0.0.1", master.port, is_master=False),
            clock=lambda: clock[0],
            ready=ready[rank],
        )
        for rank in (0, 1)
    )


def test_no_window_is_planned_until_every_rank_can_profile() -> None:
    """A rank still importing what the profiler needs would skip windows the others take."""
    clock, ready = [0.0], (threading.Event(), threading.Event())
    planner, follower = _two_ranks(30, clock, ready)
    ready[0].set()
    clock[0] += 31
    for s in (planner, follower, planner):
        s.poll(100)
    assert planner.plans == follower.plans == 0  # rank 1 is still warming up
    ready[1].set()
    follower.poll(101)
    planner.poll(101)
    follower.poll(101)
    assert planner.plans == follower.plans == 1 and planner.planned == follower.planned > 101


def test_ranks_agree_on_window_steps_through_the_store_at_any_step_time() -> None:
    """Rank 0 plans on its clock and publishes the step; a rank that reads the plan starts there too."""
    clock = [0.0]
    planner, follower = _two_ranks(30, clock)
    for now, step_ms in ((100, 2), (5000, 120)):  # a fast job, then a slow one: the lead covers LEAD_S
        for _ in range(now - 100, now):
            for s in (planner, follower):
                s.note_step(step_ms * 1_000_000)
        clock[0] += 31  # the interval passed
        planner.poll(now)
        follower.poll(now)
        assert planner.planned == follower.planned == now + math.ceil(LEAD_S / (step_ms / 1e3))
        planner.poll(now + 1)  # planned ahead already: no second plan
        assert planner.plans == follower.plans
    assert follower.missed == 0


def test_a_rank_that_read_a_plan_too_late_makes_the_next_ones_lead_longer() -> None:
    clock = [0.0]
    planner, follower = _two_ranks(30, clock)
    for _ in range(100):
        for s in (planner, follower):
            s.note_step(10_000_000)  # 10 ms steps: a lead of 2 s is 200 steps
    clock[0] += 31
    planner.poll(100)
    assert planner.planned == 300
    follower.poll(301)  # rank 1's thread got no CPU for 2 s: the window has begun without it
    assert follower.missed == 1 and follower.planned == -1
    for lead_s in (4, 8, 16, 16):  # each miss doubles the lead, up to MAX_LEAD_S
        clock[0] += 31
        step = planner.planned + 5
        planner.poll(step)
        assert planner.planned == step + lead_s * 100
        follower.poll(planner.planned + 1)
    assert follower.plans == 0 and follower.missed == 5


def test_a_slowdown_on_any_rank_triggers_a_window_for_all_ranks_at_once() -> None:
    clock = [0.0]
    planner, follower = _two_ranks(3600, clock)
    # 1 ms steps for 12 s; rank 1 alone sees them grow to 3 ms from step 12,000. Two seconds of
    # slow steps (two buckets) later, it asks for a window.
    for step in range(12_000 + 668):
        assert not follower.asking  # until the second slow second is over
        planner.note_step(1_000_000)
        follower.note_step(3_000_000 if step >= 12_000 else 1_000_000)
    assert follower.asking
    for s in (follower, planner, follower):  # the request goes out, rank 0 plans, rank 1 reads it
        s.poll(step)
    assert planner.planned == follower.planned > step
    # Then two follow-up windows 10 s apart: a finding needs more than one window.
    for _ in range(2):
        clock[0] += 10
        step = planner.planned + 5  # the last window is over
        planner.poll(step)
        follower.poll(step)
        assert planner.planned == follower.planned > step
    assert planner.plans == follower.plans == 3
    clock[0] += 10
    planner.poll(planner.planned + 5)
    assert planner.plans == 3  # nothing more until window_s


def test_windows_that_look_for_a_cause_record_stacks_and_periodic_ones_do_not_on_every_rank() -> None:
    """Start-up, triggered and follow-up windows record Python stacks; periodic ones operators
    only. The plan carries the choice, so ranks profile alike."""
    clock = [0.0]
    planner, follower = _two_ranks(30, clock)
    got, step = [], 0

    def window(request: bool = False) -> None:
        nonlocal step
        follower.asking = request
        for s in (follower, planner, follower):  # the request goes out, rank 0 plans, rank 1 reads
            s.poll(step)
        assert planner.planned == follower.planned > step
        got.append((planner.stacks, follower.stacks))
        step = planner.planned + 5  # the window is over

    for wait_s, request in (
        (10, False),
        (10, False),
        (30, False),
        (30, False),
        (1, True),
        (10, False),
        (10, False),
        (30, False),
    ):
        clock[0] += wait_s
        window(request)
    #              start-up ×2,   periodic ×2,     triggered + 2 follow-ups,     periodic
    assert got == [(True, True)] * 2 + [(False, False)] * 2 + [(True, True)] * 3 + [(False, False)]


def test_a_rank_that_stands_out_from_its_peers_with_no_jump_asks_for_a_window_once_while_it_does() -> None:
    """A rank slow since before its trigger had a history makes no jump, but its own time or CPU
    time per step stands out from its peers' block after block (CPU time here: 1.2x)."""
    clock = [1.0]  # no start-up window due yet
    planner, follower = _two_ranks(3600, clock)
    step = 0

    def blocks(own: float, cpu: float, n: int) -> None:
        nonlocal step
        for _ in range(n):
            step += 100
            planner.note_block(10_000.0, 8_000.0)
            follower.note_block(own, cpu)
            for s in (follower, planner):  # rank 1 compares its block with the others' last
                s.poll(step)

    blocks(11_000.0, 8_500.0, 5)  # 1.1x and 1.06x: within a healthy job's spread
    assert planner.plans == 0 and planner.requests_read == 0
    blocks(10_000.0, 9_600.0, 2)  # two blocks in a row: it asks, and rank 0 plans
    assert planner.requests_read == 1 and planner.plans == 1 and planner.stacks
    follower.poll(step)
    assert follower.planned == planner.planned > step and follower.stacks
    for _ in range(2):  # the two follow-ups, 10 s apart; it still stands out: no second request
        clock[0] += 10
        blocks(10_000.0, 9_600.0, 1)
    assert planner.plans == 3 and planner.requests_read == 1
    clock[0] += 3600
    blocks(10_000.0, 9_600.0, 1)
    assert planner.plans == 4 and planner.stacks  # a periodic window, with stacks while it stands out
    blocks(10_000.0, 8_000.0, 1)
    clock[0] += 3600
    blocks(10_000.0, 8_000.0, 1)
    assert planner.plans == 5 and not planner.stacks  # no rank stands out: operators only
    blocks(13_500.0, 8_000.0, 3)  # own time 1.35x, after it stopped standing out: asks again
    assert planner.requests_read == 2


def test_a_pipeline_stage_stands_out_only_against_the_ranks_of_its_stage() -> None:
    """Stage 1 carries the loss head: its own time is 1.5x stage 0's by design, and it asks for
    no window; against a replica of its own stage it would."""
    clock = [1.0]
    planner, follower = _two_ranks(3600, clock)
    planner.role, follower.role = 1, 2  # pipeline stages 0 and 1
    for step in range(100, 800, 100):
        planner.note_block(10_000.0, 8_000.0)
        follower.note_block(15_000.0, 12_000.0)
        for s in (follower, planner):
            s.poll(step)
    assert planner.requests_read == 0 and planner.plans == 0
    follower.role = 1
    for step in range(800, 1100, 100):
        planner.note_block(10_000.0, 8_000.0)
        follower.note_block(15_000.0, 12_000.0)
        for s in (follower, planner):
            s.poll(step)
    assert planner.requests_read == 1


def test_ranks_compare_their_rates_through_a_store_without_multi_get(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An older torch's store has no ``multi_get``: rank 0 reads the sample's keys one by one."""

    class OldStore:
        def __init__(self, store: torch.distributed.Store) -> None:
            self.set, self.get, self.check, self.add = store.set, store.get, store.check, store.add

    store = OldStore(torch.distributed.HashStore())
    planner, follower = (
        Schedule(window_s=3600, window_steps=5, trigger_ratio=1.5, rank=r, world_size=2, job="j",
                 store=lambda: store, clock=lambda: 1.0)
        for r in (0, 1)
    )  # fmt: skip
    for step in (100, 200, 300):
        planner.note_block(10_000.0, 8_000.0)
        follower.note_block(10_000.0, 9_600.0)
        for s in (follower, planner):
            s.poll(step)
    assert planner.requests_read == 1 and planner.plans == 1
    assert "not compared" not in caplog.text


def test_a_healthy_busy_job_does_not_trigger_but_a_lasting_slowdown_does() -> None:
    """Replays a healthy 2-rank DDP job's steps recorded on 2 shared cores (the first 5,000, ~20 s):
    runs of 20-50 steps at 2-3x come and go, on which a trigger on the last 20 steps' median fired
    119 times in the whole 40 s recording."""
    with gzip.open(Path(__file__).parents[1] / "fixtures" / "healthy_ddp_steps.json.gz", "rt") as f:
        trace = json.load(f)
    # Then the same steps again, with a slower link (every collective takes longer: each step 1.25x,
    # its own time as it was) or with this rank computing 1.5x as long (its own time 1.5x: the step
    # grows by that extra only). Either triggers within ~3 s (two whole seconds).
    for slower in (lambda d, o: (1.25 * d, o), lambda d, o: (d + 0.5 * o, 1.5 * o)):
        s = Schedule(
            window_s=30, window_steps=5, trigger_ratio=Config().trigger_ratio, rank=0, world_size=1, job="j"
        )
        for d, o in zip(trace["dur_us"], trace["own_us"], strict=True):
            s.note_step(d * 1000, o * 1000)
            assert not s.asking
        t = 0.0
        for d, o in zip(trace["dur_us"], trace["own_us"], strict=True):
            slow_d, slow_o = slower(d * 1000, o * 1000)
            s.note_step(int(slow_d), int(slow_o))
            t += slow_d
            if s.asking or t > 3.2e9:
                break
        assert s.asking and t <= 3.2e9


def test_a_request_made_while_a_window_is_planned_is_served_after_it() -> None:
    clock = [0.0]
    planner, follower = _two_ranks(3600, clock)
    clock[0] += 10
    planner.poll(0)  # the first start-up window
    first = planner.planned
    assert first > 0
    for step in range(8_700):  # rank 1's steps triple after 8 s, while that window is still ahead
        planner.note_step(1_000_000)
        follower.note_step(3_000_000 if step >= 8_000 else 1_000_000)
    assert follower.asking
    follower.poll(first - 1)  # the request goes out
    planner.poll(first - 1)  # planned ahead already: the request must wait, not be lost
    assert planner.plans == 1
    planner.poll(first + 5)  # that window is over, and no follow-up is due yet (0 s since)
    follower.poll(first + 5)
    assert planner.plans == follower.plans == 2
    assert planner.planned == follower.planned > first + 5


def test_once_a_plan_and_the_peers_rates_exist_a_follower_reads_each_with_one_request() -> None:
    """Each request of the store is a round trip that the rank's background thread waits for
    without the GIL and then takes it back from the training thread: a poll asks for what it must
    read, not first whether it is there, once it has been."""

    class Counting:
        def __init__(self, store: torch.distributed.Store) -> None:
            self.store, self.calls = store, []

        def __getattr__(self, name: str) -> object:
            self.calls.append(name)
            return getattr(self.store, name)

    stores, clock = [Counting(torch.distributed.HashStore())], [0.0]
    store = stores[0]
    planner, follower = (
        Schedule(window_s=3600, window_steps=5, trigger_ratio=1.5, rank=r, world_size=2, job="j",
                 store=lambda: stores[0], clock=lambda: clock[0])
        for r in (0, 1)
    )  # fmt: skip
    clock[0] += 3601  # a window is due
    planner.poll(100)
    for s in (follower, planner, follower):  # the plan read; the ranks' rates published, gathered, read
        s.note_block(10_000.0, 8_000.0)
        s.poll(100)
    assert follower.plans == 1
    store.calls.clear()
    follower.poll(401)  # nothing new to compare: the plan alone
    assert store.calls == ["get"]
    follower.note_block(10_000.0, 8_000.0)
    store.calls.clear()
    follower.poll(402)  # its new rates published, the peers' read, the plan read
    assert store.calls == ["set", "get", "get"]
    stores[0] = fresh = Counting(torch.distributed.HashStore())  # the process group made again
    fresh.store.set_timeout(timedelta(seconds=5))
    follower.poll(403)  # asked whether the plan is there: a get of a missing key would wait
    assert fresh.calls == ["check"]
