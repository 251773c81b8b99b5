"""A window on the training thread: what it records and holds, pausing and closing inside one,
one at a time, collectives in flight."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rankscope.profiler_hook import threadstates
from rankscope.profiler_hook.summarize import summarize
from rankscope.wire.records import (
    WindowSummary,
    decode,
)
from tests.hook.common import STASHES, in_a_window, one_rank_hook, tcp_store
from tests.records import ListSink, spool_records

# Steps, windows and threads timed on the machine's clock: no other test beside them.
pytestmark = pytest.mark.alone


@pytest.mark.releases
def test_a_window_writes_nothing_to_the_training_scripts_stderr(tmp_path: Path) -> None:
    """torch's kineto prints a line at every profiler start and stop; a window must not (a fresh
    process: the quieting applies before kineto's first use)."""
    script = f"""
from rankscope.profiler_hook.config import Config, Identity
from rankscope.profiler_hook import events, threadstates
from rankscope.profiler_hook.hook import Hook
from rankscope.profiler_hook.sinks import SpoolSink
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


def test_a_window_holds_none_of_the_hooks_own_reads() -> None:
    """The send counters are read (a readlink per open descriptor) before the profiler starts: in
    the window they read as the rank's code path, on the rank with the most descriptors."""
    sink = ListSink()
    hook = one_rank_hook(sink, heartbeat_s=60)
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
    hook = one_rank_hook(sink, heartbeat_s=60)
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


def test_pausing_inside_a_window_ends_the_window() -> None:
    """A window open when the hook pauses is dropped, not left profiling (with stacks) until resume."""
    sink = ListSink()
    hook = in_a_window(sink, steps=2)
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
    hook = one_rank_hook(sink, heartbeat_s=60, with_stack=False, window_steps=2)
    summarized: list[int] = []

    def slow(*args: Any) -> Any:
        time.sleep(0.3)
        try:
            return summarize(*args)
        finally:
            summarized.append(time.time_ns())

    monkeypatch.setattr("rankscope.profiler_hook.summarize.summarize", slow)
    started = []
    for planned, wait_s in ((1, 5.0), (4, 5.0), (7, 0.05)):
        monkeypatch.setattr("rankscope.profiler_hook.hook.SUMMARIZE_WAIT_S", wait_s)
        hook.schedule.planned = planned
        while hook.step_num < planned + 2:
            with hook.step():
                if hook.window is not None and hook.window.first == hook.step_num:
                    started.append(hook.window.started_ns)
    hook.close(timeout=30)
    assert len(started) == 2, "the third window is skipped: the second's summarizer was still running"
    assert started[1] >= summarized[0]
    assert len([r for r in map(decode, sink.got) if isinstance(r, WindowSummary)]) == 2


threadstates.uninstall()
"""Whether this Python and torch need the guard: torch 2.13+ stashes a context in each backward
pass, and Python 3.11 and older link a thread state before making it."""


@pytest.mark.releases
@pytest.mark.skipif(not STASHES, reason="Python 3.12+, or a torch that stashes no context (before 2.13)")
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

    monkeypatch.setattr("rankscope.profiler_hook.hook.SETTLE_S", 0.02)
    dist.init_process_group("gloo", store=tcp_store(), rank=0, world_size=1)
    try:
        sink = ListSink()
        hook = one_rank_hook(sink, heartbeat_s=60, window_steps=2)
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
