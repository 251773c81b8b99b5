"""Collective tracking: what the rank record says it covers, DDP models, untested backends, real
gloo ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.faults.catalogue import JobSpec
from benchmarks.faults.launch import launch
from benchmarks.procs import free_port
from rankscope import profiler_hook
from rankscope.profiler_hook import threadstates
from rankscope.profiler_hook.config import Config, Identity
from rankscope.profiler_hook.hook import Hook
from rankscope.wire.records import (
    Heartbeat,
    RankInfo,
    StepBatch,
    WindowSummary,
    coverage_gaps,
    decode,
)
from tests.hook.common import STASHES, one_rank_hook, tcp_store
from tests.records import ListSink, spool_records

# Steps, windows and threads timed on the machine's clock: no other test beside them.
pytestmark = pytest.mark.alone


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

    dist.init_process_group("gloo", store=tcp_store(), rank=0, world_size=1)
    try:
        net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        model = DDP(net)
        sink = ListSink()
        hook = one_rank_hook(sink, window_s=0, heartbeat_s=60, step_block_s=0)
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
from rankscope.profiler_hook.config import Config, Identity
from rankscope.profiler_hook import events, threadstates
from rankscope.profiler_hook.hook import Hook
from tests.records import ListSink
from rankscope.wire.records import RankInfo, decode
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


@pytest.mark.releases
@pytest.mark.skipif(not STASHES, reason="Python 3.12+, or a torch that stashes no context (before 2.13)")
def test_ddp_with_unused_parameters_found_gets_its_windows() -> None:
    """The Hugging Face Trainer builds DDP with ``find_unused_parameters=True``: its reducer holds a
    collective of the last backward pass until the next one, and no window of such a job started."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", store=tcp_store(), rank=0, world_size=1)
    try:
        net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        model = DDP(net, find_unused_parameters=True)
        sink = ListSink()
        hook = one_rank_hook(sink, heartbeat_s=60, window_steps=2)
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

    assert threadstates.install() == STASHES
    dist.init_process_group("gloo", store=tcp_store(), rank=0, world_size=1)
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


def test_a_ddp_model_on_another_process_group_is_named_with_its_group() -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", store=tcp_store(), rank=0, world_size=1)
    try:
        sub = dist.new_group([0])
        _model = DDP(torch.nn.Linear(8, 2), process_group=sub)  # built before attach
        hook = one_rank_hook(ListSink(), window_s=0, heartbeat_s=60)
        coverage = hook.coverage()
        hook.close(timeout=30)
    finally:
        dist.destroy_process_group()
    name = str(sub.group_name)
    assert f"DDP Linear on {name}: timed per backward pass" in coverage, coverage
    assert f"groups world (gloo), {name} (gloo): collectives from C++ counted, not timed" in coverage, (
        coverage
    )
