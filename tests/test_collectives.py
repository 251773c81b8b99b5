"""Every collective a real job issues is seen always-on: DDP's (launched from C++), FSDP2's and plain
calls, in spawned multi-rank gloo jobs, with the wait on the rank that waits."""

from __future__ import annotations

import gc
import os
import statistics
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import profiler_hook
from rankscope.workload import Fault, JobSpec, free_port, launch
from tests.test_hook import _records
from wire.records import Heartbeat, StepBatch

STEPS = 150


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["manual", "ddp", "fsdp2"])
def test_every_loop_shape_shows_its_collectives_and_the_wait_for_a_late_rank(
    loop: str, tmp_path: Path
) -> None:
    """Rank 1's batches arrive 20 ms late: rank 0 waits for it inside the gradient collectives."""
    launch(
        JobSpec(
            job=loop,
            world_size=2,
            hosts=1,
            port=free_port(),
            max_steps=STEPS,
            loop=loop,
            fault=Fault(kind="dataloader", rank=1, delay_ms=20),
            hook={"spool_dir": str(tmp_path), "window_s": 0, "flush_s": 0.5},
            log_dir=str(tmp_path / "logs"),
            progress=False,
        )
    )
    recs = _records(tmp_path, loop)
    # The rows are blocks of steps (totals of ``n_steps`` steps); past the first 10 steps.
    rows = {
        r: [row for x in rs if isinstance(x, StepBatch) for row in x.rows if row.step >= 10]
        for r, rs in recs.items()
    }
    # DDP: one bucket all-reduce + the loop's small all-reduce; FSDP2: gathers and reduce-scatters.
    least = {"manual": 1, "ddp": 2, "fsdp2": 4}[loop]
    for r in (0, 1):
        assert rows[r] and min(row.n_coll / row.n_steps for row in rows[r]) >= least, (r, rows[r][:3])
        assert all(row.first_coll_us >= 0 for row in rows[r])
    wait = {r: statistics.median(row.comm_us / row.n_steps for row in rows[r]) for r in (0, 1)}
    assert wait[0] > wait[1] + 10_000, wait  # the wait inversion: the healthy rank waits
    own = {r: statistics.median((row.dur_us - row.comm_us) / row.n_steps for row in rows[r]) for r in (0, 1)}
    assert own[1] > own[0] + 10_000, own  # so the late rank's own time stands out
    # Sequence numbers match across ranks: what names the rank a hang waits for.
    last = {r: [x for x in rs if isinstance(x, Heartbeat)][-1].last_seq for r, rs in recs.items()}
    assert last[0] == last[1] and last[0]["world"] >= least * STEPS


def _user_hook_job(rank: int, port: int, spool: str, out: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    hook = profiler_hook.attach(job="userhook", spool_dir=spool, rank=rank, world_size=2, window_s=0)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 8))
    built_seq = dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
    calls = []

    # Unannotated: DDP checks annotations against its types, and this module's are strings.
    def compress(state, bucket):  # type: ignore[no-untyped-def]
        calls.append(bucket.index())
        return fp16_compress_hook(state, bucket)

    model.register_comm_hook(None, compress)
    x = torch.full((4, 64), float(rank + 1))
    for i in range(10):
        if i in (5, 8):  # steps 5-7 paused: their collectives belong to no step
            hook.resume() if hook.paused else hook.pause()
        with hook.step():
            model.zero_grad()
            model(x).sum().backward()
    grad = model.module.weight.grad
    c10d_seq = dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
    seq = hook.tracker.last_seq.get("world", 0)
    throwaway = DDP(torch.nn.Linear(4, 4))
    watched = len(hook.tracker.on_patch)
    del throwaway
    gc.collect()
    hook.pause()
    hook.resume()  # forgets the model that is gone
    with open(f"{out}/rank{rank}", "w") as f:
        f.write(f"{len(calls)} {seq - c10d_seq} {float(grad[0, 0]):.4f} {c10d_seq - built_seq}")
        f.write(f" {watched} {len(hook.tracker.on_patch)}")
    hook.close()
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_users_own_ddp_comm_hook_still_runs_and_its_collectives_are_tracked(tmp_path: Path) -> None:
    mp.start_processes(
        _user_hook_job, args=(free_port(), str(tmp_path), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    got = [(tmp_path / f"rank{r}").read_text().split() for r in (0, 1)]
    # Every step ran the user's fp16 hook once; the tracked numbering is c10d's (what Flight Recorder
    # shows); the gradient is the average over ranks of x = 1 and x = 2 summed over 4 rows: 6.0.
    assert got[0][:3] == got[1][:3] == ["10", "0", "6.0000"]
    # Each collective counted once: the hook's all-reduces by their wrapper, not again as DDP's, and
    # the broadcasts DDP issues from C++ when it rebuilds its buckets after the first step; the three
    # paused steps' all-reduces not at all.
    assert got[0][4:] == got[1][4:] == ["2", "1"], got  # a DDP model that is gone is not kept
    launched = int(got[0][3])
    assert launched == 10 + 2, got  # DDP's rebuild broadcasts the bucket sizes and indices
    for rank, recs in _records(tmp_path, "userhook").items():
        rows = [row for x in recs if isinstance(x, StepBatch) for row in x.rows]
        assert sum(row.n_steps for row in rows) == 7, (rank, rows)
        assert sum(row.n_coll for row in rows) == launched - 3, (rank, rows)
        assert all(row.comm_us > 0 for row in rows), (rank, rows)
