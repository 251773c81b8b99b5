"""Shipping: a broken or slow transport never reaches the training loop; closing, the spool,
numbered records, a hook never closed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from benchmarks.procs import free_port
from rankscope import profiler_hook
from rankscope.profiler_hook.config import Config, Identity
from rankscope.profiler_hook.hook import Hook
from rankscope.profiler_hook.shipper import Shipper
from rankscope.wire.records import (
    STEP_COLUMNS,
    Heartbeat,
    RankInfo,
    StepBatch,
    decode,
)
from tests.hook.common import SlowSink, in_a_window, one_rank_hook, run_steps
from tests.records import ListSink

# Steps, windows and threads timed on the machine's clock: no other test beside them.
pytestmark = pytest.mark.alone


class _BrokenSink:
    def send(self, key: bytes, value: bytes) -> None:
        raise ConnectionError("the transport is down")

    def close(self) -> None:
        raise ConnectionError("still down")


def test_a_failing_sink_never_reaches_the_training_loop() -> None:
    hook = one_rank_hook(_BrokenSink(), flush_s=0.001, window_s=0)
    run_steps(hook, 50)
    hook.close()
    assert hook.shipper.sent == 0
    assert hook.shipper.dropped >= 2  # the rank record and step batches, all counted


def test_a_full_queue_drops_and_counts_instead_of_blocking() -> None:
    sink = SlowSink()
    hook = one_rank_hook(sink, flush_s=0.0001, queue_size=2, window_s=0)
    worst = run_steps(hook, 200)
    hook.close(timeout=30)
    assert worst < 0.05, f"a step waited {worst * 1e3:.1f} ms on the transport"
    assert hook.shipper.dropped > 0
    assert hook.shipper.sent == len(sink.got)


def test_close_ships_the_step_rows_before_it_stops_an_open_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """At SIGTERM our thread ends the process 2 s into the close: the step rows (a restart's redone
    work is measured by them) are out before a window's stop, which can take longer, even begins."""
    sink = ListSink()
    hook = in_a_window(sink, steps=3)
    stop, shipped_by_then = torch.profiler.profile.stop, []

    def slow_stop(prof: torch.profiler.profile) -> None:
        time.sleep(0.5)  # the shipper thread's time to ship what was handed to it before
        shipped_by_then.extend(r for r in map(decode, sink.got) if isinstance(r, StepBatch))
        stop(prof)

    monkeypatch.setattr(torch.profiler.profile, "stop", slow_stop)
    hook.close(timeout=30)
    assert sum(row.n_steps for r in shipped_by_then for row in r.rows) == 3, shipped_by_then


def test_close_honours_its_timeout_with_a_dead_broker_and_counts_what_it_abandons() -> None:
    port = free_port()  # nothing listens on it
    hook = Hook(
        Config(sink="kafka", kafka_bootstrap=f"127.0.0.1:{port}", window_s=0, queue_size=64, step_block_s=0,
               flush_s=1e-9),  # each step's row shipped as it ends
        Identity(rank=0, local_rank=0, world_size=1, host="h"),
    )  # fmt: skip
    submit, submitted = hook.shipper.submit, [1]  # its rank record is queued already
    hook.shipper.submit = lambda rec: submitted.append(1) or submit(rec)  # type: ignore[method-assign]
    run_steps(hook, 200)
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
    run_steps(hook, 3)
    hook.close()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) == 1 and files[0].parent.parent == spool, files
    first = decode(files[0].read_bytes().splitlines()[0])
    assert isinstance(first, RankInfo) and (first.job, first.host) == (job, host)


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
from rankscope import profiler_hook
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
    from benchmarks.procs import free_port

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
