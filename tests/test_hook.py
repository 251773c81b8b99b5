"""The in-rank hook: wire records, light import, summaries of real profiler output, failure modes,
and real multi-rank gloo jobs."""

from __future__ import annotations

import gc
import gzip
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import profiler_hook
from benchmarks.workload import JobSpec, free_port, launch
from profiler_hook import events, threadstates
from profiler_hook.blocks import StepBlocks
from profiler_hook.collectives import CollectiveTracker
from profiler_hook.config import Config, Identity
from profiler_hook.hook import Hook
from profiler_hook.schedstat import ThreadWait
from profiler_hook.schedule import LEAD_S, Schedule
from profiler_hook.shipper import Shipper
from profiler_hook.summarize import library_frame, summarize
from tests.records import ListSink, spool_records
from wire.errors import UsageError
from wire.records import (
    STEP_COLUMNS,
    Heartbeat,
    RankInfo,
    StepBatch,
    WindowSummary,
    coverage_gaps,
    decode,
    sample_key,
)

# Steps, windows and threads timed on the machine's clock: no other test beside them.
pytestmark = pytest.mark.alone


def test_public_api_is_sorted_and_importable() -> None:
    # isort-style order, as ruff keeps it: CONSTANTS, then Classes, then functions.
    def order(name: str) -> tuple[int, str]:
        return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)

    assert profiler_hook.__all__ == sorted(profiler_hook.__all__, key=order)
    for name in profiler_hook.__all__:
        assert hasattr(profiler_hook, name)


def test_importing_the_hook_loads_nothing_heavy() -> None:
    code = (
        "import sys, profiler_hook; "
        "print([m for m in ('pandas', 'clickhouse_connect', 'chdb', 'fastapi', 'kafka', 'torch') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_step_rows_are_blocks_that_every_rank_cuts_alike() -> None:
    """Ranks at slightly different step times cut their steps into the same power-of-two blocks,
    aligned on step numbers; a jump in step numbers, or steps that slow down, end a block early."""
    cuts = []
    for step_us in (10_000, 10_200, 10_400):  # ranks of one job: ~10 ms a step, give or take
        blocks = StepBlocks(2.0)
        for step in range(2000):
            blocks.add(step, step * step_us, step_us + step % 7 * 100, 0, step_us // 2, 3, 100)
        rows = blocks.take()
        end = rows[-1].step + rows[-1].n_steps
        assert [s for r in rows for s in range(r.step, r.step + r.n_steps)] == list(range(end))
        assert end > 2000 - 256  # the rest is in the open block
        assert all(r.n_coll == 3 * r.n_steps and r.first_coll_us == 100 for r in rows)
        assert [r.n_steps for r in rows[:2]] == [1, 255] and {r.n_steps for r in rows[2:]} == {256}
        cuts.append([r.step for r in rows])
    assert cuts[0] == cuts[1] == cuts[2]
    assert cuts[0][3] - cuts[0][2] == 256  # 2.6 s: the power of two nearest to 2 s
    blocks = StepBlocks(2.0)
    for step in list(range(300)) + list(range(1000, 1010)):  # a jump: the open block ends before it
        blocks.add(step, 0, 10_000, 0, 0, 0, -1)
    blocks.add(1010, 0, 5_000_000, 0, 0, 0, -1)  # a 5 s step: its block ends with it
    rows = blocks.take()
    assert rows[-1].step + rows[-1].n_steps == 1011 and all(r.first_coll_us == -1 for r in rows)
    assert any(r.step + r.n_steps == 300 for r in rows)
    blocks.add(1011, 0, 5_000_000, 0, 0, 0, -1)
    assert [r.n_steps for r in blocks.take()] == [1] and blocks.length == 1  # slow steps: a row each


def test_a_blocks_cpu_time_is_its_steps_own_read_once_per_block() -> None:
    """The training thread's CPU time lands in the block of the steps that spent it; a pause's does not."""
    sink = ListSink()
    hook = Hook(
        Config(window_s=0, heartbeat_s=60, step_block_s=0),
        Identity(rank=0, local_rank=0, world_size=1, host="h"),
        sink,
    )

    def spin(s: float) -> None:
        end = time.thread_time() + s
        while time.thread_time() < end:
            pass

    for busy in (0.0, 0.05, 0.0):
        with hook.step():
            spin(busy)
    hook.pause()
    spin(0.1)  # paused: counted nowhere
    hook.resume()
    with hook.step():
        time.sleep(0.05)  # waiting is not CPU time
    hook.close(timeout=30)
    rows = [row for r in map(decode, sink.got) if isinstance(r, StepBatch) for row in r.rows]
    cpu = [row.cpu_us for row in sorted(rows, key=lambda r: r.step)]
    assert len(cpu) == 4 and 45_000 <= cpu[1] <= 60_000, cpu
    assert max(cpu[0], cpu[2], cpu[3]) < 10_000, cpu


def test_a_close_from_another_thread_still_counts_the_last_blocks_cpu_time() -> None:
    """A SIGTERM handler, or the harness of a hung job, closes the hook on another thread than the
    training thread: the last block still gets the training thread's CPU time (it once got none,
    and no run-queue wait either, which read as more own time than its peers')."""
    sink = ListSink()
    hook = Hook(
        Config(window_s=0, heartbeat_s=60, step_block_s=60),
        Identity(rank=0, local_rank=0, world_size=1, host="h"),
        sink,
    )
    for _ in range(4):
        with hook.step():
            end = time.thread_time() + 0.02
            while time.thread_time() < end:
                pass
    closer = threading.Thread(target=hook.close, kwargs={"timeout": 30})
    closer.start()
    closer.join()
    rows = [row for r in map(decode, sink.got) if isinstance(r, StepBatch) for row in r.rows]
    assert sum(r.n_steps for r in rows) == 4
    assert 75_000 <= sum(r.cpu_us for r in rows) <= 120_000, rows


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="no schedstat")
def test_a_threads_run_queue_wait_is_read_from_another_thread_and_grows_only_while_it_queues() -> None:
    """CPU hogs in other processes (more than there are cores) make a spinning thread queue for a
    CPU; a sleeping one does not queue. Read through ``ThreadWait`` from another thread."""
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range((os.cpu_count() or 1) + 1)
    ]
    try:
        main, reads = ThreadWait(), {}

        def read(key: str) -> None:
            reads[key] = main()

        def on_the_side(key: str) -> None:  # another thread reads the main thread's wait
            t = threading.Thread(target=read, args=(key,))
            t.start()
            t.join()

        on_the_side("before")
        time.sleep(0.3)
        on_the_side("slept")
        end = time.thread_time() + 0.3
        while time.thread_time() < end:  # 0.3 s of CPU among the hogs: longer in the run queue
            pass
        on_the_side("spun")
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    main.close()
    assert main() == 0  # closed: reads nothing
    assert reads["slept"] - reads["before"] < 0.05e9, reads
    assert reads["spun"] - reads["slept"] > 0.05e9, reads


def test_a_steps_run_queue_wait_inside_collectives_is_not_counted_as_its_own() -> None:
    """``StepRow.wait_us`` is the training thread's wait outside collectives: the block's growth of
    the counter less what grew inside the collectives the step waited in (a counter stands in for
    the kernel's, so that the amounts are exact)."""
    counter = iter(range(0, 10**9, 1_000_000))  # +1 ms of wait at every read
    tracker = CollectiveTracker(thread_wait=lambda: next(counter))
    call = tracker.enter("world", "all_reduce", 8)  # read 1
    tracker.exit(call)  # read 2: 1 ms inside the call
    launched = tracker.enter("world", "all_reduce", 8, blocking=False)  # read 3
    tracker.exit(launched)  # read 4: the step's last asynchronous call counts too
    comm_ns, n, _, comm_wait_ns, waited_ns = tracker.take_step(time.perf_counter_ns())
    assert n == 2 and comm_wait_ns == 2_000_000 and waited_ns == comm_ns
    usage = iter([(0, 0, 0, 0), (0, 0, 10_000, 0)])  # CPU µs, switches, wait µs, GC µs: start, end
    blocks = StepBlocks(0.0, lambda: next(usage))
    blocks.add(0, 0, 20_000, 0, comm_ns // 1000, n, 0, comm_wait_ns // 1000)
    (row,) = blocks.take()
    assert row.wait_us == 10_000 - 2_000


def test_the_wait_inside_collectives_is_read_once_in_100_ms_and_counted_at_that_share_between() -> None:
    """Each read of the kernel's counter costs ~17 µs in a training step: the steps in between
    count their collectives' wait at the share the last read ones waited."""
    reads: list[int] = []

    def wait() -> int:
        reads.append(1)
        return len(reads) * 1_000_000  # +1 ms of wait at every read

    tracker = CollectiveTracker(thread_wait=wait)
    tracker.exit(tracker.enter("world", "all_reduce", 8))
    *_, comm_wait_ns, waited_ns = tracker.take_step(time.perf_counter_ns())
    assert len(reads) == 2 and comm_wait_ns == 1_000_000 and waited_ns > 0
    tracker.exit(tracker.enter("world", "all_reduce", 8))  # the next step, within 100 ms: not read
    *_, comm_wait_ns, waited_ns = tracker.take_step(time.perf_counter_ns())
    assert len(reads) == 2 and comm_wait_ns == waited_ns == 0
    usage = iter([(0, 0, 0, 0), (0, 0, 10_000, 0), (0, 0, 20_000, 0)])
    blocks = StepBlocks(0.0, lambda: next(usage))  # a row per step
    blocks.add(0, 0, 20_000, 0, 4_000, 1, 0, 1_000, 4_000)  # read: a quarter of the time waited
    blocks.add(1, 20_000, 20_000, 0, 2_000, 1, 0, 0, 0)  # not read: counted at a quarter
    assert [r.wait_us for r in blocks.take()] == [10_000 - 1_000, 10_000 - 500]


def test_config_rejects_bad_settings_naming_the_field() -> None:
    with pytest.raises(UsageError, match="window_steps"):
        Config(window_steps=0)
    with pytest.raises(UsageError, match="window_s"):
        Config(window_s=-1)
    with pytest.raises(UsageError, match="sink"):
        Config(sink="carrier-pigeon")
    with pytest.raises(UsageError, match="queue_size"):
        Config(queue_size=0)
    with pytest.raises(UsageError, match="trigger_ratio"):
        Config(trigger_ratio=0.9)


def audit(model: torch.nn.Module) -> float:
    return sum(float(p.detach().norm()) for p in model.parameters())


@pytest.mark.releases
def test_summary_of_real_profiler_output() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    data = torch.utils.data.TensorDataset(torch.randn(256, 32), torch.randint(0, 4, (256,)))
    loader = torch.utils.data.DataLoader(data, batch_size=32)
    t0 = time.time_ns()
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for x, y in loader:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            audit(model)
    window_ns = time.time_ns() - t0
    functions, busy, n = summarize(prof.profiler.kineto_results, [], window_ns, max_functions=300)
    assert n > 100
    # The 300 largest, and one more pattern that says what was left out: a function missing from
    # a window may have run there, below what was kept.
    everything, _, _ = summarize(prof.profiler.kineto_results, [], window_ns, max_functions=10**6)
    assert len(everything) > 300 and functions[:300] == everything[:300]
    (cut,) = functions[300:]
    assert (cut.kind, cut.count, cut.max_us) == ("cut", len(everything) - 300, everything[300].total_us)
    assert cut.total_us == pytest.approx(sum(f.total_us for f in everything[300:]), abs=0.1)
    by = {(f.kind, f.name.rsplit(": ", 1)[-1]): f for f in functions}
    # The Python function is identified by its name and the stack that called it.
    audit_fn = by[("python", "audit")]
    assert audit_fn.count == 8
    assert "test_summary_of_real_profiler_output" in audit_fn.stack
    assert by[("op", "aten::addmm")].count == 16  # two layers x eight batches
    # The job's own functions, apart from the interpreter's, the standard library's and packages'.
    assert ("pylib", "_call_impl") in by
    assert not [f.name for f in functions if f.kind == "python" and f.name.startswith(("torch/", "<"))]
    loader_fn = next(f for (k, _), f in by.items() if k == "dataloader")
    assert loader_fn.count >= 8
    for f in functions:
        assert f.p50_us <= f.p90_us <= f.max_us + 1e-6
        # mean is rounded to 0.01 us, total to 0.1 us
        assert f.mean_us * f.count == pytest.approx(f.total_us, rel=0.001, abs=0.005 * f.count + 0.1)
        assert " at 0x" not in f.name  # object addresses differ per rank: stripped
    assert 0 < busy["compute"] <= 1 and 0 <= busy["idle"] < 1


@pytest.mark.releases
def test_a_pipeline_schedules_microbatches_are_one_function_of_its_stage() -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        stage = PipelineStage(model, 0, 1, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss)
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        schedule.step(x, target=y)
        t0 = time.time_ns()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                schedule.step(x, target=y)
        functions, _, _ = summarize(prof.profiler.kineto_results, [], time.time_ns() - t0, max_functions=300)
    finally:
        torch.distributed.destroy_process_group()
    # The schedule annotates each microbatch's work ("Forward 0" ... "Backward 3"): one function of
    # the stage, run 4 times a step, so that a slower stage's excess is not split over its microbatches.
    by = {f.name: f.count for f in functions if f.kind == "op"}
    assert (by.get("Forward"), by.get("Backward")) == (8, 8)
    assert not [name for name in by if name.startswith(("Forward ", "Backward "))]


def pause_for_garbage_collection() -> None:
    time.sleep(0.15)


@pytest.mark.releases
def test_a_call_that_holds_most_of_a_window_is_an_execution_but_the_loop_around_it_is_not() -> None:
    """The frames open when the window starts and ends (the loop, its callers) are left out; a long
    call inside it — a garbage-collection pause taking most of a 5-step window — is kept."""
    model = torch.nn.Linear(32, 4)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        t0 = time.time_ns()  # after the start: a process's first one imports for ~1 s
        for step in range(5):
            model(torch.randn(8, 32)).sum().backward()
            if step == 2:
                pause_for_garbage_collection()
        window_ns = time.time_ns() - t0
    functions, _, _ = summarize(prof.profiler.kineto_results, [], window_ns, max_functions=300)
    names = {f.name.rsplit(": ", 1)[-1]: f for f in functions if f.kind == "python"}
    pause = names["pause_for_garbage_collection"]
    assert pause.count == 1 and pause.total_us >= 0.5 * window_ns / 1e3
    assert (
        "test_a_call_that_holds_most_of_a_window_is_an_execution_but_the_loop_around_it_is_not" not in names
    )


def test_library_frames_are_told_from_the_jobs_own_code() -> None:
    for name in (
        "torch/nn/modules/module.py(1751): _call_impl",  # an installed package
        "enum.py(686): __call__",  # the standard library, as the profiler shortens its paths
        "<built-in method item of Tensor object>",
        "profiler_hook/collectives.py(130): wrapper",  # the hook's own frames
        f"{os.path.dirname(profiler_hook.__file__)}/collectives.py(130): wrapper",  # an editable install's
        "/usr/lib/python3/dist-packages/yaml/__init__.py(10): load",
        "nn.Module: Linear_1",  # torch's module class
        "nn.Module: Sequential_0",
        "nn.Module: DistributedDataParallel_0",  # not in torch.nn itself
    ):
        assert library_frame(name), name
    for name in (
        "train.py(12): train_step",
        "test_hook.py(50): audit",
        "/home/u/job/model.py(3): forward",
        "nn.Module: CausalSelfAttention_0",  # the job's own module class
    ):
        assert not library_frame(name), name


class _BrokenSink:
    def send(self, key: bytes, value: bytes) -> None:
        raise ConnectionError("the transport is down")

    def close(self) -> None:
        raise ConnectionError("still down")


class _SlowSink:
    def __init__(self) -> None:
        self.got: list[bytes] = []

    def send(self, key: bytes, value: bytes) -> None:
        time.sleep(0.2)
        self.got.append(value)

    def close(self) -> None:
        pass


def test_a_steps_garbage_collection_is_timed_in_the_block_of_the_steps_it_stopped() -> None:
    """A full collection every other step (a clean-up the job calls), on a heap of a few hundred
    thousand objects: each lands in its step's row, the steps between collect (next to) nothing."""
    heap = [[i] for i in range(300_000)]  # objects a full collection traverses
    sink = ListSink()
    hook = Hook(
        Config(window_s=0, heartbeat_s=60, step_block_s=0),
        Identity(rank=0, local_rank=0, world_size=1, host="h"),
        sink,
    )
    timed = []
    for step in range(6):
        with hook.step():
            if step % 2:
                t = time.perf_counter_ns()
                gc.collect()
                timed.append((time.perf_counter_ns() - t) // 1000)
    hook.close(timeout=30)
    del heap
    rows = sorted(row for r in map(decode, sink.got) if isinstance(r, StepBatch) for row in r.rows)
    collected = [row.gc_us for row in rows]
    assert len(collected) == 6, collected
    assert all(0 < c <= t for c, t in zip(collected[1::2], timed, strict=True)), (collected, timed)
    assert sum(collected[1::2]) >= 0.8 * sum(timed), (collected, timed)
    assert max(collected[0::2]) < 0.1 * min(timed), collected


def _steps(hook: Hook, n: int) -> float:
    """Run n trivial steps; the longest step in seconds."""
    worst = 0.0
    for _ in range(n):
        t = time.perf_counter()
        with hook.step():
            pass
        worst = max(worst, time.perf_counter() - t)
    return worst


def test_a_failing_sink_never_reaches_the_training_loop() -> None:
    hook = Hook(
        Config(flush_s=0.001, window_s=0),
        Identity(rank=0, local_rank=0, world_size=1, host="h"),
        _BrokenSink(),
    )
    _steps(hook, 50)
    hook.close()
    assert hook.shipper.sent == 0
    assert hook.shipper.dropped >= 2  # the rank record and step batches, all counted


def test_a_full_queue_drops_and_counts_instead_of_blocking() -> None:
    sink = _SlowSink()
    hook = Hook(
        Config(flush_s=0.0001, queue_size=2, window_s=0),
        Identity(rank=0, local_rank=0, world_size=1, host="h"),
        sink,
    )
    worst = _steps(hook, 200)
    hook.close(timeout=30)
    assert worst < 0.05, f"a step waited {worst * 1e3:.1f} ms on the transport"
    assert hook.shipper.dropped > 0
    assert hook.shipper.sent == len(sink.got)


def _store() -> torch.distributed.TCPStore:
    """A real c10d store, as ``init_process_group`` makes one for every job."""
    return torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _two_ranks(
    window_s: float, clock: list[float], ready: tuple[threading.Event | None, ...] = (None, None)
) -> tuple[Schedule, Schedule]:
    """Rank 0's and rank 1's schedules of one job, each with its own client of one real store."""
    master = _store()
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
    with gzip.open(Path(__file__).parent / "fixtures" / "healthy_ddp_steps.json.gz", "rt") as f:
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


def test_a_hook_profiles_on_its_clock() -> None:
    sink = ListSink()
    hook = Hook(
        Config(window_s=0.2, window_steps=3, with_stack=False, window_budget=1.0),
        Identity(rank=0, local_rank=0, world_size=1, host="h"),
        sink,
    )
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3.5:  # a plan every 0.2 s, each LEAD_S (2 s) ahead
        with hook.step():
            time.sleep(0.005)
    hook.close()
    wins = [r for r in map(decode, sink.got) if isinstance(r, WindowSummary)]
    assert len(wins) >= 1
    assert all(w.step_hi - w.step_lo == 3 for w in wins)


def test_disabled_hook_is_a_no_op(tmp_path: Path) -> None:
    hook = profiler_hook.attach(enable=False, spool_dir=str(tmp_path), rank=0, world_size=1)
    _steps(hook, 5)
    hook.close()
    assert not list(tmp_path.rglob("*.jsonl"))


def test_stalled_rank_heartbeat_carries_its_stack() -> None:
    hook = Hook(
        Config(window_s=0, heartbeat_s=60, stall_s=0.05),
        Identity(rank=0, local_rank=0, world_size=1, host="h"),
        _SlowSink(),
    )
    hook.begin_step(0)
    hb: list[Heartbeat] = []

    def later() -> None:
        time.sleep(0.2)
        hb.append(hook.watchdog.beat())

    t = threading.Thread(target=later)
    t.start()
    t.join()
    hook.end_step()
    after = hook.watchdog.beat()
    hook.close(timeout=30)
    assert hb[0].progress_age_s >= 0.05
    assert "test_stalled_rank_heartbeat_carries_its_stack" in hb[0].stack
    assert (hb[0].step, after.step) == (-1, 0), "a heartbeat names the last step finished, not the one begun"


def read_from_storage(seconds: float) -> None:
    time.sleep(seconds)  # a slow read: the thread waits in no Python frame of its own


@pytest.mark.releases
def test_heartbeats_carry_the_function_of_the_jobs_code_each_stack_sample_found_the_thread_in() -> None:
    """The watchdog samples the innermost function of the job's own code the training thread is in,
    named as torch's profiler names it, so that samples and windows name a function alike, and the
    line it is at."""
    hook = Hook(
        Config(window_s=0, heartbeat_s=60),
        Identity(rank=0, local_rank=0, world_size=1, host="h"),
        _SlowSink(),
    )
    hook.watchdog.beat()  # takes the samples so far

    def sample() -> None:
        time.sleep(0.05)
        for _ in range(5):
            hook.watchdog.sampler.sample()
            time.sleep(0.02)

    t = threading.Thread(target=sample)
    t.start()
    read_from_storage(0.4)
    t.join()
    beat = hook.watchdog.beat()
    hook.close(timeout=30)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        read_from_storage(0.001)
    profiled = {
        e.name for e in events.read(prof.profiler.kineto_results) if e.name.endswith(": read_from_storage")
    }
    assert len(profiled) == 1
    sleep_line = read_from_storage.__code__.co_firstlineno + 1
    assert beat.samples.get(sample_key(profiled.pop(), sleep_line), 0) >= 5, (beat.samples, profiled)
    assert not [f for f in beat.samples if f.startswith(("torch/", "threading.py", "profiler_hook"))]


def free_memory() -> None:
    gc.collect()


def test_a_sample_due_while_the_garbage_collector_held_the_gil_counts_where_it_collected() -> None:
    """The sampler's thread waits for the GIL while a collection holds it, and samples after it,
    where the training thread may have left the function that collected (the samples of a rank
    that collected for 60% of its time once never found the function): a sample due meanwhile
    counts where the collection ran. Here the training thread samples itself, after the
    collection, from another function."""
    heap = [[i] for i in range(300_000)]  # a full collection of several ms
    hook = Hook(
        Config(window_s=0, heartbeat_s=60),
        Identity(rank=0, local_rank=0, world_size=1, host="h"),
        _SlowSink(),
    )
    hook.watchdog.beat()  # takes the samples so far
    free_memory()
    start, end, _ = hook._gc.last

    def sample_elsewhere() -> None:
        hook.watchdog.sampler.sample((start + end) // 2)  # due during the collection
        hook.watchdog.sampler.sample(end + 1)  # due after it

    sample_elsewhere()
    samples = hook.watchdog.beat().samples
    hook.close(timeout=30)
    del heap
    line = sample_elsewhere.__code__.co_firstlineno
    [(collected, during), (elsewhere, after)] = sorted(samples.items(), key=lambda kv: "elsewhere" in kv[0])
    assert collected.endswith(f"free_memory @{free_memory.__code__.co_firstlineno + 1}"), samples
    assert elsewhere.endswith(f"sample_elsewhere @{line + 2}") and during == after == 1, samples


def test_a_paused_hook_is_not_a_stalled_rank() -> None:
    """hook.pause() (an evaluation loop, a benchmark's A/B) stops the step clock: no stall, no stack."""
    hook = Hook(
        Config(window_s=0, heartbeat_s=60, stall_s=0.05),
        Identity(rank=0, local_rank=0, world_size=1, host="h"),
        _SlowSink(),
    )
    with hook.step():
        pass
    hook.pause()
    time.sleep(0.2)
    beat = hook.watchdog.beat()
    hook.resume()
    hook.close(timeout=30)
    assert beat.progress_age_s < 0.05 and beat.stack == ""


@pytest.mark.releases
def test_a_window_writes_nothing_to_the_training_scripts_stderr(tmp_path: Path) -> None:
    """torch's kineto prints a line at every profiler start and stop; a window must not (a fresh
    process: the quieting applies before kineto's first use)."""
    script = f"""
from profiler_hook.config import Config, Identity
from profiler_hook import events, threadstates
from profiler_hook.hook import Hook
from profiler_hook.sinks import SpoolSink
ident = Identity(rank=0, local_rank=0, world_size=1, host="h")
cfg = Config(job="quiet", spool_dir={str(tmp_path)!r}, heartbeat_s=60)
hook = Hook(cfg, ident, SpoolSink(cfg.spool_dir, cfg.job, ident))
hook.schedule.planned = 1
for _ in range(10):
    with hook.step():
        sum(range(1000))
hook.close(timeout=30)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stderr == "", out.stderr
    wins = [r for rs in spool_records(tmp_path, "quiet").values() for r in rs if isinstance(r, WindowSummary)]
    assert len(wins) == 1


@pytest.mark.releases
def test_the_rank_record_says_what_collective_tracking_covers() -> None:
    ident = Identity(rank=0, local_rank=0, world_size=1, host="h")
    got = {}
    for patch in (True, False):
        sink = ListSink()
        Hook(Config(window_s=0, heartbeat_s=60, patch_collectives=patch), ident, sink).close(timeout=30)
        got[patch] = [r.coverage for r in map(decode, sink.got) if isinstance(r, RankInfo)]
    assert got == {
        True: ["torch.distributed calls (plain, FSDP, FSDP2, pipelining, DTensor): timed; DDP: no model yet"],
        False: ["off (patch_collectives=False)"],
    }


@pytest.mark.releases
def test_a_ddp_model_built_before_attach_is_timed_and_the_rank_record_says_so_per_model_and_group() -> None:
    """People add the hook where their loop is, after ``DistributedDataParallel(model)``: its
    synchronization is timed all the same, the rank record names it, and it says again, stamped as
    before, what changed when a second model is built later; close leaves the models untouched."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", store=_store(), rank=0, world_size=1)
    try:
        net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        model = DDP(net)
        sink = ListSink()
        hook = Hook(
            Config(window_s=0, heartbeat_s=60, step_block_s=0),
            Identity(rank=0, local_rank=0, world_size=1, host="h"),
            sink,
        )
        for _ in range(20):
            with hook.step():
                model(torch.randn(32, 64)).sum().backward()
        head = DDP(torch.nn.Linear(8, 2))
        hook.watchdog.beat()  # what a heartbeat does first: say a changed coverage
        hook.close(timeout=30)
        hooked_after_close = [len(p._backward_hooks or {}) for p in [*net.parameters(), *head.parameters()]]
    finally:
        dist.destroy_process_group()
    infos = [r for r in map(decode, sink.got) if isinstance(r, RankInfo)]
    calls = "torch.distributed calls (plain, FSDP, FSDP2, pipelining, DTensor): timed"
    groups = "groups world (gloo): collectives from C++ counted, not timed"
    assert [r.coverage for r in infos] == [
        f"{calls}; DDP Sequential on world: timed per backward pass; {groups}",
        f"{calls}; DDP Sequential on world: timed per backward pass; "
        f"DDP Linear on world: timed per backward pass; {groups}",
    ]
    assert infos[0].time_us == infos[1].time_us, "one start of the rank: the store keeps the latest"
    rows = [row for r in map(decode, sink.got) if isinstance(r, StepBatch) for row in r.rows]
    assert len(rows) == 20 and all(row.comm_us > 0 and row.first_coll_us >= 0 for row in rows), rows[:3]
    assert hooked_after_close == [0] * len(hooked_after_close)


def test_an_untested_backend_is_said_once_in_the_log_and_in_the_rank_record() -> None:
    """Also a backend without sequence numbers: its groups are named once in the log, and the
    steps go on with the collectives launched from C++ on them uncounted."""
    script = """
import logging, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from profiler_hook.config import Config, Identity
from profiler_hook import events, threadstates
from profiler_hook.hook import Hook
from tests.records import ListSink
from wire.records import RankInfo, decode
logging.basicConfig(level=logging.WARNING, format="%(message)s")
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
sink = ListSink()
hook = Hook(Config(window_s=0, heartbeat_s=60, step_block_s=0), Identity(rank=0, local_rank=0, world_size=2, host="h"), sink)
for _ in range(3):  # each step ends a block, which counts the collectives c10d numbered
    with hook.step():
        pass
hook.close()
print([r.coverage for r in map(decode, sink.got) if isinstance(r, RankInfo)], hook.failures)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    said = (
        "torch.distributed calls (plain, FSDP, FSDP2, pipelining, DTensor): timed; DDP: no model yet; "
        "group world (fake): not tracked (no sequence numbers: collectives from C++ uncounted); "
        "backend fake: untested (counts and waits as the CPU sees them)"
    )
    assert out.stdout.strip() == f"{[said]!r} 0", out
    gaps = "; ".join(coverage_gaps(said))
    assert out.stderr.count("rankscope: collective tracking: " + gaps) == 1, out.stderr
    unnumbered = "rankscope: process groups ['world'] have no sequence numbers (backend without them)"
    assert out.stderr.count(unnumbered) == 1, out.stderr


def test_a_window_holds_none_of_the_hooks_own_reads() -> None:
    """The send counters are read (a readlink per open descriptor) before the profiler starts: in
    the window they read as the rank's code path, on the rank with the most descriptors."""
    sink = ListSink()
    hook = Hook(Config(heartbeat_s=60), Identity(rank=0, local_rank=0, world_size=1, host="h"), sink)
    hook.schedule.planned = 1
    x = torch.ones(64, 64)
    for _ in range(8):
        with hook.step():
            x = torch.tanh(x @ x)
    hook.close(timeout=30)
    (win,) = [r for r in map(decode, sink.got) if isinstance(r, WindowSummary)]
    names = [f.name for f in win.functions]
    assert any("aten::mm" in n for n in names), names
    assert not [n for n in names if "readlink" in n or "listdir" in n], names


@pytest.mark.releases
def test_a_window_records_python_functions_only_where_its_plan_asks_for_stacks() -> None:
    sink = ListSink()
    hook = Hook(Config(heartbeat_s=60), Identity(rank=0, local_rank=0, world_size=1, host="h"), sink)
    x = torch.ones(64, 64)
    for stacks in (False, True):
        hook.schedule.stacks, hook.schedule.planned = stacks, hook.step_num + 2
        for _ in range(8):
            with hook.step():
                x = torch.tanh(x @ x)
        assert hook.wait_summaries(30)
    hook.close(timeout=30)
    wins = [r for r in map(decode, sink.got) if isinstance(r, WindowSummary)]
    kinds = [{f.kind for f in w.functions} for w in sorted(wins, key=lambda w: w.window)]
    assert len(kinds) == 2 and all("op" in k for k in kinds), kinds
    assert not kinds[0] & {"python", "pylib"} and kinds[1] & {"python", "pylib"}, kinds


def _in_a_window(sink: ListSink, steps: int) -> Hook:
    """A hook whose planned window opened at its second step, ``steps`` steps in."""
    hook = Hook(Config(heartbeat_s=60), Identity(rank=0, local_rank=0, world_size=1, host="h"), sink)
    hook.schedule.planned = 1
    for _ in range(steps):
        with hook.step():
            pass
    assert hook.window is not None, "the planned window is open"
    return hook


def test_close_ships_the_step_rows_before_it_stops_an_open_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """At SIGTERM our thread ends the process 2 s into the close: the step rows (a restart's redone
    work is measured by them) are out before a window's stop, which can take longer, even begins."""
    sink = ListSink()
    hook = _in_a_window(sink, steps=3)
    stop, shipped_by_then = torch.profiler.profile.stop, []

    def slow_stop(prof: torch.profiler.profile) -> None:
        time.sleep(0.5)  # the shipper thread's time to ship what was handed to it before
        shipped_by_then.extend(r for r in map(decode, sink.got) if isinstance(r, StepBatch))
        stop(prof)

    monkeypatch.setattr(torch.profiler.profile, "stop", slow_stop)
    hook.close(timeout=30)
    assert sum(row.n_steps for r in shipped_by_then for row in r.rows) == 3, shipped_by_then


def test_pausing_inside_a_window_ends_the_window() -> None:
    """A window open when the hook pauses is dropped, not left profiling (with stacks) until resume."""
    sink = ListSink()
    hook = _in_a_window(sink, steps=2)
    hook.pause()
    assert hook.window is None and hook.tracker.recording is None
    hook.resume()
    for _ in range(10):
        with hook.step():
            pass
    hook.close(timeout=30)
    assert not [r for r in map(decode, sink.got) if isinstance(r, WindowSummary)]


def test_a_window_starts_only_once_the_last_one_is_summarized(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's Python tracer hooks every thread at start: the summarizer of the last window must not
    run (or end) inside the next one. It waits for it, and skips the window if it takes too long."""
    sink = ListSink()
    hook = Hook(
        Config(heartbeat_s=60, with_stack=False, window_steps=2),
        Identity(rank=0, local_rank=0, world_size=1, host="h"),
        sink,
    )
    summarized: list[int] = []

    def slow(*args: Any) -> Any:
        time.sleep(0.3)
        try:
            return summarize(*args)
        finally:
            summarized.append(time.time_ns())

    monkeypatch.setattr("profiler_hook.summarize.summarize", slow)
    started = []
    for planned, wait_s in ((1, 5.0), (4, 5.0), (7, 0.05)):
        monkeypatch.setattr("profiler_hook.hook.SUMMARIZE_WAIT_S", wait_s)
        hook.schedule.planned = planned
        while hook.step_num < planned + 2:
            with hook.step():
                if hook.window is not None and hook.window.first == hook.step_num:
                    started.append(hook.window.started_ns)
    hook.close(timeout=30)
    assert len(started) == 2, "the third window is skipped: the second's summarizer was still running"
    assert started[1] >= summarized[0]
    assert len([r for r in map(decode, sink.got) if isinstance(r, WindowSummary)]) == 2


_STASHES = threadstates.install()
threadstates.uninstall()
"""Whether this Python and torch need the guard: torch 2.13+ stashes a context in each backward
pass, and Python 3.11 and older link a thread state before making it."""


@pytest.mark.releases
@pytest.mark.skipif(not _STASHES, reason="Python 3.12+, or a torch that stashes no context (before 2.13)")
def test_a_window_waits_for_a_collective_in_flight_but_not_for_a_context_a_live_owner_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A collective launched in the backward pass holds the context torch stashed for it; the thread
    that drops it last makes a Python thread state to free it, and torch's Python tracer, setting
    every thread's profile function at a window's start and end, crashed on one half made (a SIGSEGV
    in 1 of ~14 DDP runs). Here the script holds its all-reduces' handles over steps, as DDP's
    reducer holds its used-parameter map's all-reduce with ``find_unused_parameters=True``: those
    completed, and their handles are freed on the training thread, so windows start as planned. A
    collective still in flight (a late peer's, entered in the tracker and completed a step later)
    may be dropped by a collective's thread at any moment: the window planned then is skipped."""
    import torch.distributed as dist

    monkeypatch.setattr("profiler_hook.hook.SETTLE_S", 0.02)
    dist.init_process_group("gloo", store=_store(), rank=0, world_size=1)
    try:
        sink = ListSink()
        hook = Hook(
            Config(heartbeat_s=60, window_steps=2),
            Identity(rank=0, local_rank=0, world_size=1, host="h"),
            sink,
        )
        w = torch.ones(64, requires_grad=True)
        works: list = []
        w.register_hook(lambda g: works.append(dist.all_reduce(g.clone(), async_op=True)) and None)
        profiling, late = {}, None
        for step, plan in enumerate((-1, 1, -1, -1, 4, -1)):
            if plan >= 0:
                hook.schedule.planned = plan
            if step == 4:
                late = hook.tracker.enter("world", "all_reduce", 0, blocking=False)
            with hook.step():
                profiling[step] = hook.window is not None
                (w * 2).sum().backward()
            if late is not None:
                hook.tracker.exit(late)
            assert len(threadstates._shared()) >= 1, "the script's handles hold the contexts"
        hook.close(timeout=30)
    finally:
        dist.destroy_process_group()
    assert profiling == {0: False, 1: True, 2: True, 3: False, 4: False, 5: False}
    (win,) = [r for r in map(decode, sink.got) if isinstance(r, WindowSummary)]
    assert (win.step_lo, win.step_hi) == (1, 3)


@pytest.mark.releases
@pytest.mark.skipif(not _STASHES, reason="Python 3.12+, or a torch that stashes no context (before 2.13)")
def test_ddp_with_unused_parameters_found_gets_its_windows() -> None:
    """The Hugging Face Trainer builds DDP with ``find_unused_parameters=True``: its reducer holds a
    collective of the last backward pass until the next one, and no window of such a job started."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", store=_store(), rank=0, world_size=1)
    try:
        net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        model = DDP(net, find_unused_parameters=True)
        sink = ListSink()
        hook = Hook(
            Config(heartbeat_s=60, window_steps=2),
            Identity(rank=0, local_rank=0, world_size=1, host="h"),
            sink,
        )
        started = []
        for step in range(12):
            if step in (2, 7):
                hook.schedule.planned = step
            with hook.step():
                started.append(hook.window is not None)
                model(torch.randn(32, 64)).sum().backward()
        held = len(threadstates._shared())
        hook.close(timeout=30)
    finally:
        dist.destroy_process_group()
    assert held >= 1, "DDP's reducer holds the last pass's context, as it did when no window started"
    assert [i for i, s in enumerate(started) if s] == [2, 3, 7, 8]
    assert len([r for r in map(decode, sink.got) if isinstance(r, WindowSummary)]) == 2


def test_ddps_all_reduces_let_go_of_the_backward_passes_context_by_the_end_of_the_step() -> None:
    """Under DDP, nothing of the script's holds a collective: its threads drop the context of each
    backward pass, so no window is lost waiting for them."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    assert threadstates.install() == _STASHES
    dist.init_process_group("gloo", store=_store(), rank=0, world_size=1)
    try:
        model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
        for _ in range(20):
            model(torch.randn(32, 64)).sum().backward()
            assert threadstates.settle(1.0)
    finally:
        dist.destroy_process_group()
        threadstates.uninstall()


@pytest.mark.releases
@pytest.mark.slow
def test_hook_in_spawned_gloo_ranks(tmp_path: Path) -> None:
    # Windows every 0.5 s whatever they cost (window_budget=1): many windows to compare across ranks.
    hook = {
        "spool_dir": str(tmp_path),
        "window_s": 0.5,
        "window_steps": 4,
        "window_budget": 1.0,
        "flush_s": 0.5,
    }
    stats = launch(
        JobSpec(
            job="mr",
            world_size=4,
            port=free_port(),
            max_steps=300,
            loop="manual",  # one all-reduce per step, counted exactly (DDP: tests/test_collectives.py)
            hook=hook,
            log_dir=str(tmp_path / "logs"),
            progress=False,
        )
    )
    assert [s["steps"] for s in stats] == [300] * 4
    assert all(s["dropped"] == 0 for s in stats)
    recs = spool_records(tmp_path, "mr")
    assert sorted(recs) == [0, 1, 2, 3]
    windows = {}
    for rank, rs in recs.items():
        assert sum(isinstance(r, profiler_hook.RankInfo) for r in rs) == 1
        rows = [row for r in rs if isinstance(r, StepBatch) for row in r.rows]
        steps = [s for row in rows for s in range(row.step, row.step + row.n_steps)]
        assert steps == list(range(300))  # every step once, in order
        assert all(row.n_coll == row.n_steps and row.comm_us > 0 for row in rows)  # an all-reduce a step
        wins = [r for r in rs if isinstance(r, WindowSummary)]
        windows[rank] = [(w.window, w.step_lo, w.step_hi) for w in wins]
        for i, w in enumerate(sorted(wins, key=lambda w: w.window)):
            kinds = {f.kind for f in w.functions}
            # A batch is fetched before its step begins: a window of one step holds no fetch.
            assert {"op", "collective"} | ({"dataloader"} if w.step_hi - w.step_lo > 1 else set()) <= kinds
            # Stacks in the second start-up window (the first measures what a window costs, without).
            assert i != 1 or "python" in kinds
            # gloo's annotation of each all-reduce is communication, not an operator of the model.
            assert {f.kind for f in w.functions if f.name.startswith("gloo:")} == {"collective"}
            assert len(json.dumps([list(f) for f in w.functions])) < 100_000  # the per-window budget
        last = [r for r in rs if isinstance(r, Heartbeat)][-1]
        assert last.last_seq == {"world": 301}  # 300 all-reduces + the final barrier, on every rank
    # Windows cover the same steps on every rank: that is what makes ranks comparable.
    assert windows[0] and all(lo == w and lo < hi <= lo + 4 for w, lo, hi in windows[0])  # id = first step
    assert all(w == windows[0] for w in windows.values())
    hosts = {r.rank: r.host for rs in recs.values() for r in rs if isinstance(r, profiler_hook.RankInfo)}
    assert hosts == {0: "node0", 1: "node0", 2: "node1", 3: "node1"}


def _bulk_sender() -> tuple[socket.socket, socket.socket, Callable[[int], None], Callable[[], None]]:
    """An idle and a bulk loopback connection to a reading server, ``send(n)`` that waits until ``n``
    more bytes were read, and ``close()``."""
    server = socket.create_server(("127.0.0.1", 0))
    received = 0

    def read(conn: socket.socket) -> None:
        nonlocal received
        with conn:
            while chunk := conn.recv(1 << 20):
                received += len(chunk)

    def accept() -> None:
        for _ in range(2):
            threading.Thread(target=read, args=(server.accept()[0],), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    idle = socket.create_connection(server.getsockname())
    bulk = socket.create_connection(server.getsockname())

    def send(n: int) -> None:
        goal = received + n
        bulk.sendall(b"x" * n)
        deadline = time.monotonic() + 10
        while received < goal and time.monotonic() < deadline:
            time.sleep(0.01)

    def close() -> None:
        idle.close()
        bulk.close()
        acceptor.join(10)
        server.close()

    return idle, bulk, send, close


def test_heartbeats_carry_each_links_sends_from_a_real_bulk_transfer_and_not_idle_connections() -> None:
    from profiler_hook.netstat import MIN_BYTES, LinkMeter, tcp_counters

    hook = Hook(
        Config(window_s=0, heartbeat_s=60),
        Identity(rank=0, local_rank=0, world_size=1, host="h"),
        _SlowSink(),
    )
    _, _, send, close = _bulk_sender()
    try:
        assert not tcp_counters()  # loopback connections never touch a NIC: left out by default
        hook.watchdog.links = LinkMeter(loopback=True)  # here they stand for a NIC's
        assert hook.watchdog.beat().sends == {}  # nothing to compare with yet
        send(32 << 20)
        beat = hook.watchdog.beat()
        quiet = hook.watchdog.beat()
    finally:
        close()
        hook.close(timeout=30)
    # One link, host > peer: the bulk connection's bytes (the idle one's few left out) and its time.
    assert list(beat.sends) == ["127.0.0.1>127.0.0.1"], beat
    nbytes, us = beat.sends["127.0.0.1>127.0.0.1"]
    assert 32 << 20 <= nbytes < (32 << 20) + MIN_BYTES and us > 0
    assert quiet.sends == {}  # nothing sent since


def test_a_process_with_many_descriptors_reads_its_bulk_connections_between_full_scans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from profiler_hook import netstat

    monkeypatch.setattr(netstat, "MAX_SCAN", 0)  # every process has "many"
    links = netstat.LinkMeter(loopback=True)
    idle, bulk, send, close = _bulk_sender()
    try:
        read: list[int] = []
        monkeypatch.setattr(netstat.os, "dup", lambda fd, dup=os.dup: read.append(fd) or dup(fd))
        links.read()  # the first two reads are full scans: the second finds the bulk connection
        send(1 << 20)
        assert links.read()
        read.clear()
        send(1 << 20)
        sends = links.read()  # the bulk connection alone
        assert read == [bulk.fileno()], (read, bulk.fileno(), idle.fileno())
    finally:
        close()
    nbytes, _ = sends["127.0.0.1>127.0.0.1"]
    assert 1 << 20 <= nbytes < (1 << 20) + netstat.MIN_BYTES


_WAIT_PROBE = """
import json, os, sys, time
from profiler_hook.schedstat import run_queue_wait, wait_pattern
os.sched_setaffinity(0, {int(sys.argv[1])})
sys.stdin.readline()  # the hogs run on this core now
before, wall, cpu = run_queue_wait(), time.perf_counter(), time.thread_time()
while time.thread_time() - cpu < 0.2:  # never sleeps: off the CPU only while waiting for it
    pass
p = wait_pattern(before, run_queue_wait())
wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
print(json.dumps({"wait_s": p.total_us / 1e6, "wall_s": wall, "cpu_s": cpu, "pattern": [p.kind, p.name, p.count]}))
"""


def test_cpu_wait_is_the_time_a_thread_queued_behind_hogs_on_its_core() -> None:
    from wire.records import WAIT_PATTERN

    core = max(os.sched_getaffinity(0))
    probe = subprocess.Popen(
        [sys.executable, "-c", _WAIT_PROBE, str(core)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    hogs = []
    try:
        for _ in range(2):
            hogs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
            os.sched_setaffinity(hogs[-1].pid, {core})
        assert probe.stdin is not None and probe.stdout is not None
        probe.stdin.write("go\n")
        probe.stdin.flush()
        out = json.loads(probe.stdout.readline())
    finally:
        for p in [*hogs, probe]:
            p.kill()
            p.wait()
    assert out["pattern"] == ["sched", WAIT_PATTERN, 1]
    # A thread that never sleeps is either on the CPU or waiting for it: wait = wall - CPU time.
    # Sharing the core with two hogs, it gets about a third of it and waits about two thirds.
    assert out["wait_s"] == pytest.approx(out["wall_s"] - out["cpu_s"], rel=0.2)
    assert out["wait_s"] >= 0.5 * out["wall_s"]


@pytest.mark.parametrize(
    ("where", "settings", "env"),
    [
        ("a spool dir that cannot be created", {"spool_dir": "/proc/rankscope"}, {}),
        ("a spool dir under a file", {"spool_dir": "/dev/null/rankscope"}, {}),
        ("RANK=abc", {}, {"RANK": "abc", "WORLD_SIZE": "2"}),
    ],
)
def test_attach_never_raises_for_what_the_environment_does_wrong(
    where: str, settings: dict, env: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    hook = profiler_hook.attach(**{"spool_dir": str(tmp_path), **settings})
    assert (hook.enabled, hook.failures) == (False, 1), where
    _steps(hook, 3)  # the job trains on
    hook.close()


_IMPORTER_PROBE = """
import sys, threading, time
import torch
assert "torch._inductor" not in sys.modules
importers = []

class Probe:  # notes which thread imports torch._inductor
    def find_spec(self, name, path=None, target=None):
        if name == "torch._inductor":
            importers.append(threading.current_thread().name)
        return None

sys.meta_path.insert(0, Probe())
from profiler_hook.config import Config, Identity
from profiler_hook import events, threadstates
from profiler_hook.hook import Hook
from wire.records import WindowSummary, decode

class Sink:
    got = []
    def send(self, key, value): self.got.append(value)
    def close(self): pass

hook = Hook(Config(window_s=0.2, window_steps=3, with_stack=False),
            Identity(rank=0, local_rank=0, world_size=1, host="h"), Sink())
at_attach = list(importers)
torch.optim.SGD(torch.nn.Linear(2, 2).parameters())  # the script's own imports (torch._dynamo)
t0, worst = time.monotonic(), 0.0
while time.monotonic() - t0 < 60 and not any(isinstance(decode(r), WindowSummary) for r in Sink.got):
    t = time.perf_counter()
    with hook.step():
        time.sleep(0.005)
    worst = max(worst, time.perf_counter() - t)
hook.close()
print(at_attach, importers, worst < 0.5, any(isinstance(decode(r), WindowSummary) for r in Sink.got))
"""


def test_the_profilers_first_start_is_paid_at_attach_not_by_a_step() -> None:
    """torch.profiler's first start() imports torch._inductor (~1.7 s): the hook does it at attach,
    on the script's thread (on a thread of its own it raced the script's imports), so no step waits."""
    out = subprocess.run(
        [sys.executable, "-c", _IMPORTER_PROBE], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "['MainThread'] ['MainThread'] True True"


def test_close_honours_its_timeout_with_a_dead_broker_and_counts_what_it_abandons() -> None:
    port = free_port()  # nothing listens on it
    hook = Hook(
        Config(sink="kafka", kafka_bootstrap=f"127.0.0.1:{port}", window_s=0, queue_size=64, step_block_s=0,
               flush_s=1e-9),  # each step's row shipped as it ends
        Identity(rank=0, local_rank=0, world_size=1, host="h"),
    )  # fmt: skip
    submit, submitted = hook.shipper.submit, [1]  # its rank record is queued already
    hook.shipper.submit = lambda rec: submitted.append(1) or submit(rec)  # type: ignore[method-assign]
    _steps(hook, 200)
    t0 = time.monotonic()
    hook.close(timeout=2.0)
    took = time.monotonic() - t0
    assert took < 5.0, took  # 20 s with a 10 s timeout before
    assert hook.shipper.sent == 0
    assert hook.shipper.dropped == len(submitted) > 40  # every record lost is counted, none silently


@pytest.mark.parametrize(
    ("job", "host"),
    [
        ("../../x", "node1"),
        ("/abs/x", "../../../x"),
        ("a\0b", "/etc/cron.d/x"),  # a job id no file could be named after, kept whole in the records
        ("j" * 5000, "."),
        ("..", ".."),
    ],
)
def test_the_spool_sink_writes_inside_the_spool_whatever_the_job_id_or_host(
    job: str, host: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANKSCOPE_HOST", host)
    spool = tmp_path / "spool"
    hook = profiler_hook.attach(job=job, spool_dir=str(spool), window_s=0, patch_collectives=False)
    assert (hook.enabled, hook.failures) == (True, 0)
    _steps(hook, 3)
    hook.close()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) == 1 and files[0].parent.parent == spool, files
    first = decode(files[0].read_bytes().splitlines()[0])
    assert isinstance(first, RankInfo) and (first.job, first.host) == (job, host)


def test_a_job_id_falling_back_to_none_is_warned_about_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Multi-node torchrun without --rdzv-id sets TORCHELASTIC_RUN_ID=none: unrelated runs would share it."""
    monkeypatch.delenv("RANKSCOPE_JOB", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setattr(profiler_hook.config, "_warned_shared_job", False, raising=False)
    with caplog.at_level(logging.WARNING, logger="profiler_hook.config"):
        assert [Config().job, Config().job] == ["none", "none"]
        Config(job="chosen")
    assert len(caplog.records) == 1 and "TORCHELASTIC_RUN_ID=none" in caplog.text
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3f2a")
    monkeypatch.setattr(profiler_hook.config, "_warned_shared_job", False, raising=False)
    caplog.clear()
    assert Config().job == "3f2a" and not caplog.records


def test_the_shipper_numbers_what_it_ships_and_a_dropped_record_keeps_its_number() -> None:
    """Records leave numbered in order with the process's pid; one dropped by a full queue takes
    its number with it, so that the store sees the gap."""
    entered, release = threading.Event(), threading.Event()

    class SlowSink(ListSink):
        def send(self, key: bytes, value: bytes) -> None:
            entered.set()
            release.wait(10)
            super().send(key, value)

    sink = SlowSink()
    shipper = Shipper(sink, 1, pid=4_000_001)  # a pid of its own: numbers count per process
    beats = [Heartbeat(job="j", rank=0, host="h", time_us=t, step=t, progress_age_s=0.1) for t in range(4)]
    assert shipper.submit(beats[0]) and entered.wait(10)  # in the sink's hands: number 0
    assert shipper.submit(beats[1])  # queued
    assert not shipper.submit(beats[2])  # the queue is full: dropped, number 1 gone with it
    release.set()
    time.sleep(0.2)
    assert shipper.submit(beats[3])
    shipper.close()
    got = [decode(v) for v in sink.got]
    assert [(r.time_us, r.pid, r.seq) for r in got] == [
        (0, 4_000_001, 0),
        (1, 4_000_001, 2),
        (3, 4_000_001, 3),
    ]
    assert shipper.dropped == 1


_UNCLOSED = """
import os, signal, sys, threading, time
from datetime import timedelta
import profiler_hook
hook = profiler_hook.attach(job="exit", spool_dir=sys.argv[1], rank=0, world_size=1, window_s=0, flush_s=60)
for step in range(30):
    with hook.step():
        time.sleep(0.001)
if sys.argv[2] == "sigterm":
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)  # the signal ends the process first
elif sys.argv[2] == "sigterm-in-c":  # as a worker stuck in a collective whose peer died
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[3], rank=0, world_size=2,
                            timeout=timedelta(seconds=120))  # the second rank never comes: blocks in C++
elif sys.argv[2] == "sigterm-while-closing":  # the peer died: its collective raised here, the exit
    send = hook.shipper.sink.send             # closes the hook, and torchrun's SIGTERM comes meanwhile
    def slow_send(key, value, signalled=[]):
        if not signalled:
            signalled.append(os.kill(os.getpid(), signal.SIGTERM))
        time.sleep(0.2)
        send(key, value)
    hook.shipper.sink.send = slow_send
    raise RuntimeError("Connection closed by peer")
"""


@pytest.mark.parametrize("end", ["return", "sigterm", "sigterm-in-c", "sigterm-while-closing"])
def test_a_hook_never_closed_ships_its_last_steps_when_the_process_ends(tmp_path: Path, end: str) -> None:
    """torchrun stops a failed attempt's surviving workers with SIGTERM (perhaps stuck in a
    collective: they must still die at once, as without the hook); scripts forget close()."""
    from benchmarks.workload import free_port

    t0 = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-c", _UNCLOSED, str(tmp_path), end, str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - t0
    # Dead of the signal (the handler, main thread free) or exit 143 (our thread, main thread stuck).
    assert run.returncode in ((0,) if end == "return" else (-signal.SIGTERM, 128 + signal.SIGTERM)), (
        run.stderr[-2000:]
    )
    if end == "sigterm-in-c":
        assert run.returncode == 128 + signal.SIGTERM and took < 30, (run.returncode, took)
    records = [
        json.loads(line) for path in tmp_path.rglob("*.jsonl") for line in path.read_text().splitlines()
    ]
    rows = [row for r in records if r["type"] == "steps" for row in r["rows"]]
    assert sum(row[STEP_COLUMNS.index("n_steps")] for row in rows) == 30, rows
    # One exit record says how the process ended: closed at its normal end, or by torchrun's SIGTERM.
    exits = [(r["how"], r.get("signal", 0)) for r in records if r["type"] == "exit"]
    said = {"return": [("close", 0)], "sigterm": [("signal", 15)], "sigterm-in-c": [("signal", 15)]}
    assert exits == said.get(end, exits) and len(exits) == 1, exits


def test_close_waits_for_the_watchdog_thread_inside_a_slow_call_of_the_jobs_store(tmp_path: Path) -> None:
    """The watchdog thread polls the window schedule in the job's store: C++, the GIL released. A
    daemon thread that returns from such a call while the interpreter shuts down aborts the process
    ("terminate called without an active exception", SIGABRT: a rank of CI's DDP job, and a
    10-line script with a TCPStore, 6 of 6 times). So ``close`` waits for it within its timeout, not
    for 1 s: a store call on a busy host can take longer."""
    hook = profiler_hook.attach(spool_dir=str(tmp_path), rank=0, world_size=1, window_s=0)
    inside = threading.Event()

    def slow_store_call() -> None:
        inside.set()
        time.sleep(1.5)

    hook.schedule.poll = lambda step: slow_store_call()  # type: ignore[method-assign]
    assert inside.wait(5)
    hook.close(timeout=5)
    assert "rankscope-watchdog" not in [t.name for t in threading.enumerate()]


@pytest.mark.parametrize(
    ("version", "said"), [("2.7.1+cpu", True), ("2.8.0", False), ("2.15.0", False), ("2.16.0", True)]
)
def test_a_torch_outside_the_tested_releases_is_said_once_in_one_line(
    version: str, said: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from profiler_hook import hook as hook_module

    monkeypatch.setattr(torch, "__version__", version)
    with caplog.at_level(logging.WARNING, logger="profiler_hook.hook"):
        hook_module._check_release.__wrapped__()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == (
        [
            f"rankscope: torch {version} is outside the releases the hook is tested on (2.8 to 2.15): it keeps what it can"
        ]
        if said
        else []
    )


def test_a_ddp_model_on_another_process_group_is_named_with_its_group() -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", store=_store(), rank=0, world_size=1)
    try:
        sub = dist.new_group([0])
        _model = DDP(torch.nn.Linear(8, 2), process_group=sub)  # built before attach
        hook = Hook(
            Config(window_s=0, heartbeat_s=60),
            Identity(rank=0, local_rank=0, world_size=1, host="h"),
            ListSink(),
        )
        coverage = hook.coverage()
        hook.close(timeout=30)
    finally:
        dist.destroy_process_group()
    name = str(sub.group_name)
    assert f"DDP Linear on {name}: timed per backward pass" in coverage, coverage
    assert f"groups world (gloo), {name} (gloo): collectives from C++ counted, not timed" in coverage, (
        coverage
    )
