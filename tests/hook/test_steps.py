"""Step rows: blocks every rank cuts alike, each block's CPU time, the run-queue wait inside and
outside collectives, garbage collections."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
import weakref

import pytest

from rankscope.profiler_hook.blocks import StepBlocks
from rankscope.profiler_hook.collectives import MAX_NOTED, CollectiveTracker
from rankscope.profiler_hook.schedstat import ThreadWait
from rankscope.wire.records import (
    StepBatch,
    decode,
)
from tests.hook.common import one_rank_hook
from tests.records import ListSink

# Steps, windows and threads timed on the machine's clock: no other test beside them.
pytestmark = pytest.mark.alone


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
    hook = one_rank_hook(sink, window_s=0, heartbeat_s=60, step_block_s=0)

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
    hook = one_rank_hook(sink, window_s=0, heartbeat_s=60, step_block_s=60)
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
    tracker.take_step(time.perf_counter_ns())  # the step before: read 0 marks where this one begins
    call = tracker.enter("world", "all_reduce", 8)  # read 1
    tracker.exit(call)  # read 2: 1 ms inside the call
    launched = tracker.enter("world", "all_reduce", 8, blocking=False)  # read 3
    tracker.exit(launched)  # read 4: the step's last asynchronous call counts too
    comm_ns, n, _, comm_wait_ns, step_wait_ns, _ = tracker.take_step(time.perf_counter_ns())  # read 5
    assert n == 2 and comm_wait_ns == 2_000_000 and step_wait_ns == 5_000_000
    usage = iter([(0, 0, 0, 0), (0, 0, 10_000, 0)])  # CPU µs, switches, wait µs, GC µs: start, end
    blocks = StepBlocks(0.0, lambda: next(usage))
    blocks.add(0, 0, 20_000, 0, comm_ns // 1000, n, 0, comm_wait_ns // 1000, step_wait_ns // 1000)
    (row,) = blocks.take()
    assert row.wait_us == 10_000 - 4_000  # 2 of the step's 5 ms read inside its collectives


def test_the_wait_inside_collectives_is_read_at_a_bounded_cost_and_counted_at_the_last_share() -> None:
    """Each read of the kernel's counter costs ~20 µs in a training step: the steps read it 100 ms
    apart, further where their calls are many (the reads kept to ``WAIT_READ_SHARE`` of the time),
    and a block counts inside its collectives the share of its wait that its read steps waited
    inside theirs, or the last block's that read any: never more than all of it."""
    reads: list[int] = []

    def wait() -> int:
        reads.append(1)
        return len(reads) * 1_000_000  # +1 ms of wait at every read

    tracker = CollectiveTracker(thread_wait=wait)
    t = time.perf_counter_ns()

    def step(calls: int, at_ms: float) -> tuple[int, int]:
        for _ in range(calls):
            tracker.exit(tracker.enter("world", "all_reduce", 8))
        *_, comm_wait_ns, step_wait_ns, _ = tracker.take_step(t + int(at_ms * 1e6))
        return comm_wait_ns, step_wait_ns

    assert step(1, 0) == (0, -1) and len(reads) == 1  # the first step reads none: it marks the next
    assert step(1, 20) == (1_000_000, 3_000_000) and len(reads) == 4  # where it began, each call, its end
    assert step(1, 50) == (0, -1) and len(reads) == 4  # the step after it, within 100 ms: not read
    step(1, 150)  # ...nor this one, which ends 100 ms after the read step began: the next one reads
    assert len(reads) == 5
    step(10, 200)  # read: its 10 calls' 20 reads take 400 µs, so the next read is 800 ms on
    assert len(reads) == 26
    step(1, 900)
    assert len(reads) == 26
    step(1, 950)  # ends 800 ms after the read step began: marks where the next begins
    assert len(reads) == 27
    step(1, 1_010)
    assert len(reads) == 30
    step(1, 1_050)  # within 100 ms of the read step's start: not read; the next is
    assert len(reads) == 31
    for end_ms in (1_900, 2_750, 3_600):  # steps longer than 100 ms: each one reads
        assert step(1, end_ms)[1] > 0
    assert len(reads) == 31 + 3 * 3
    usage = iter([(0, 0, 0, 0), *((0, 0, 10_000 * i, 0) for i in range(1, 5))])
    blocks = StepBlocks(0.0, lambda: next(usage))  # a row per step
    blocks.add(0, 0, 20_000, 0, 4_000, 1, 0, 1_000, 4_000)  # read: a quarter of its wait inside
    blocks.add(1, 20_000, 20_000, 0, 4_000, 1, 0, 3_000, 4_000)  # read: three quarters
    blocks.add(2, 40_000, 20_000, 0, 2_000, 1, 0, 0, -1)  # not read: at the last read share
    blocks.add(3, 60_000, 20_000, 0, 2_000, 1, 0, 9_000, 3_000)  # more inside than in all: all
    assert [r.wait_us for r in blocks.take()] == [10_000 - 2_500, 10_000 - 7_500, 10_000 - 7_500, 0]


def test_a_blocks_wait_outside_collectives_is_the_read_steps_share_of_its_time_off_the_cpu_there() -> None:
    """Where the steps read their CPU time too, a block counts as its wait outside collectives the
    share of its time outside them off the CPU (step time less the collectives' and the CPU time)
    that the read steps waited for a CPU there, each read step weighing ``OFF_POOL`` less at each
    one after it; never more than the block waited in all."""
    cpu = [0, 10, 23, 43, 60, 70]  # ms of CPU time and of run-queue wait at each block's end
    wait = [0, 5, 13, 16, 60, 70]
    usage = iter((c * 1000, 0, w * 1000, 0) for c, w in zip(cpu, wait, strict=True))
    blocks = StepBlocks(0.0, lambda: next(usage))  # a row per step
    tracker = CollectiveTracker(thread_wait=iter(range(0, 10**9, 1_000_000)).__next__)
    tracker.thread_cpu = iter(range(0, 10**9, 3_000_000)).__next__
    tracker.take_step(0)
    tracker.exit(tracker.enter("world", "all_reduce", 8))
    *_, step_wait_ns, step_cpu_ns = tracker.take_step(1)  # the step's CPU time read where it begins and ends
    assert (step_wait_ns, step_cpu_ns) == (3_000_000, 3_000_000)
    blocks.add(0, 0, 20_000, 0, 4_000, 1, 0, 1_000, 5_000, 10_000)  # read: 4 of its 6 ms off the CPU
    blocks.add(1, 0, 20_000, 0, 4_000, 1, 0, 0, -1, -1)  # 3 ms off the CPU: 2 ms of wait, not 8 x 0.8
    blocks.add(2, 0, 40_000, 0, 0, 1, 0, 1_000, 3_000, 20_000)  # read: 2 of 20 ms (pooled: all its 3)
    blocks.add(3, 0, 40_000, 0, 10_000, 1, 0, 0, -1, -1)  # 13 ms: at (0.75 x 4 + 2) / (0.75 x 6 + 20)
    blocks.add(4, 0, 100_000, 0, 10_000, 1, 0, 0, -1, -1)  # 80 ms: at most the 10 ms it waited
    rows = blocks.take()
    assert [r.wait_us for r in rows] == [4_000, 2_000, 3_000, round(13_000 * 5 / 24.5), 10_000]
    assert rows[1].wait_us < 8_000 * (1 - 1 / 5)  # what the share of the wait inside would count


def test_a_point_to_point_call_reads_the_wait_where_the_thread_waits_on_it_only() -> None:
    """An ``isend``/``irecv`` is timed where the thread waits on its work, and reads the run-queue
    wait there (and where it completes): its launch, where the thread does not wait, reads none."""
    reads: list[int] = []

    def wait() -> int:
        reads.append(1)
        return len(reads) * 1_000_000

    tracker = CollectiveTracker(thread_wait=wait)
    tracker.take_step(time.perf_counter_ns())  # the step before: marks where this one begins
    reads.clear()
    call = tracker.enter("world", "send", 8, blocking=False, peer=1)
    assert not reads and call.enter_wait_ns == -1
    tracker.begin_wait(call)
    tracker.exit(call)
    *_, comm_wait_ns, step_wait_ns, _ = tracker.take_step(time.perf_counter_ns())
    assert len(reads) == 3 and comm_wait_ns == 1_000_000 and step_wait_ns == 2_000_000


def test_a_lean_steps_calls_are_noted_and_counted_and_numbered_at_its_end_as_in_full() -> None:
    """At a step that neither reads the run-queue wait nor records a window, a wrapper only notes a
    call and times it; the step's end counts and numbers it as the full path does. The call the
    thread is inside reads as the full path records it (a hang's heartbeat reads it so), and no
    note keeps a tensor alive. Noted calls with no step's end are counted at ``MAX_NOTED``."""
    tracker, inside = CollectiveTracker(), []

    class Tensor:
        nbytes = 8

    def send(tensor, dst=None, group=None, tag=0, group_dst=None):  # type: ignore[no-untyped-def]
        inside.append(tracker.oldest_inflight())
        time.sleep(0.002)

    def all_reduce(tensor, op=None, group=None, async_op=False):  # type: ignore[no-untyped-def]
        inside.append(tracker.oldest_inflight())

    send_w, all_reduce_w = tracker._wrap_p2p("send", send), tracker._wrap("all_reduce", all_reduce)
    tracker.take_step(time.perf_counter_ns())
    tracker.take_step(time.perf_counter_ns())  # the first step after it reads the wait: not lean
    assert not tracker.read_wait and tracker.recording is None
    t = Tensor()
    kept = weakref.ref(t)
    send_w(t, 1)
    all_reduce_w(t)
    all_reduce_w(tensor=t, async_op=False)
    del t
    assert kept() is None
    assert [(c.group, c.op, c.seq, c.peer) for c in inside if c is not None] == [
        ("world", "send", 1, 1), ("world", "all_reduce", 2, -1), ("world", "all_reduce", 3, -1)
    ]  # fmt: skip
    assert tracker.oldest_inflight() is None and tracker.entered() == {"world": 3}
    comm_ns, count, first_ns, *_ = tracker.take_step(time.perf_counter_ns())
    assert count == 3 and comm_ns >= 2_000_000 and first_ns > 0
    assert tracker.last_seq == tracker.counted == {"world": 3} and not tracker.noted
    tracker.recording = []  # a window: every call in full, with its bytes
    send_w(Tensor(), 1)
    tracker.take_step(time.perf_counter_ns())
    assert [(c.op, c.seq, c.nbytes, c.peer) for c in tracker.recording] == [("send", 4, 8, 1)]
    tracker.recording, tracker.read_wait = None, False  # lean again, however long this took
    for _ in range(MAX_NOTED + 5):
        all_reduce_w(Tensor())
    assert len(tracker.noted) < MAX_NOTED
    assert tracker.take_step(time.perf_counter_ns())[1] == MAX_NOTED + 5
    assert tracker.last_seq == {"world": 4 + MAX_NOTED + 5}


def test_a_steps_garbage_collection_is_timed_in_the_block_of_the_steps_it_stopped() -> None:
    """A full collection every other step (a clean-up the job calls), on a heap of a few hundred
    thousand objects: each lands in its step's row, the steps between collect (next to) nothing."""
    heap = [[i] for i in range(300_000)]  # objects a full collection traverses
    sink = ListSink()
    hook = one_rank_hook(sink, window_s=0, heartbeat_s=60, step_block_s=0)
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


_WAIT_PROBE = """
import json, os, sys, time
from rankscope.profiler_hook.schedstat import run_queue_wait, wait_pattern
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
    from rankscope.wire.records import WAIT_PATTERN

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
