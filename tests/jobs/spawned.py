"""The jobs tests/test_collectives.py spawns (``torch.multiprocessing``, ``spawn``), in a module of
their own: each spawned process imports the module its function is in, and this one imports only
torch and the hook, not the test module's benchmarks, pandas and diagnosis."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rankscope import profiler_hook


def user_hook_job(rank: int, port: int, spool: str, out: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    hook = profiler_hook.attach(job="userhook", spool_dir=spool, rank=rank, world_size=2, window_s=0)
    world = dist.distributed_c10d._get_default_group()
    attached_seq = world._get_sequence_number_for_group()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 8))
    built_seq = world._get_sequence_number_for_group()
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
    c10d_seq = world._get_sequence_number_for_group()
    seq = hook.tracker.last_seq.get("world", 0)
    with open(f"{out}/rank{rank}", "w") as f:
        f.write(f"{len(calls)} {seq - c10d_seq} {float(grad[0, 0]):.4f} {c10d_seq - built_seq}")
        f.write(f" {c10d_seq - attached_seq}")
    hook.close()
    dist.destroy_process_group()


STUCK_AT = 12
"""The step rank 1 is stuck in: for 3 s before the tensor-parallel all-reduce rank 0 waits in, or
``P2P_STUCK_S`` before the transfer rank 0 waits for."""
P2P_STUCK_S = 2.0


def launched_from_cxx_job(rank: int, port: int, spool: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    hook = profiler_hook.attach(
        job="cxx", spool_dir=spool, rank=rank, world_size=2, window_s=0, step_block_s=0, flush_s=0.5,
        heartbeat_s=0.2, stall_s=1.0,
    )  # fmt: skip
    torch.manual_seed(0)  # tensor parallelism: both ranks take the same batch
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}  # the forward ends in an all-reduce
    tp, x = parallelize_module(model, init_device_mesh("cpu", (2,)), plan), torch.randn(4, 32)
    world = dist.distributed_c10d._get_default_group()
    seqs = []
    for step in range(20):
        with hook.step():
            if step == STUCK_AT and rank == 1:
                time.sleep(3)
            seqs.append(world._get_sequence_number_for_group())
            tp(x).sum().backward()
            if step == 15:  # a process group's own method, as a C++ extension would call it
                world.allreduce([torch.ones(2)]).wait()
    fsdp = FSDP(torch.nn.Linear(32, 32), device_id=torch.device("cpu"))
    for _ in range(10):
        with hook.step():
            fsdp(x).sum().backward()
    seqs.append(world._get_sequence_number_for_group())
    Path(out, f"rank{rank}").write_text(" ".join(map(str, seqs)))
    hook.close()
    dist.destroy_process_group()


def megatron_groups_job(rank: int, port: int, spool: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    hook = profiler_hook.attach(job="megatron", spool_dir=spool, rank=rank, world_size=4, window_s=0)
    # As megatron.core.parallel_state.initialize_model_parallel(tensor_model_parallel_size=2,
    # pipeline_model_parallel_size=2) makes them on 4 ranks, after the hook: every rank makes
    # every group, in one order; tensor-parallel groups of consecutive ranks, pipelines strided.
    for desc, groups in (
        ("DATA_PARALLEL_GROUP", [[0], [1], [2], [3]]),
        ("TENSOR_MODEL_PARALLEL_GROUP", [[0, 1], [2, 3]]),
        ("PIPELINE_MODEL_PARALLEL_GROUP", [[0, 2], [1, 3]]),
        ("EMBEDDING_GROUP", [[0, 2], [1, 3]]),
    ):
        for ranks in groups:
            dist.new_group(ranks, group_desc=desc)
    for _ in range(3):
        with hook.step():
            dist.all_reduce(torch.ones(1))
    hook.close()
    dist.destroy_process_group()


def pipeline_without_mesh_job(rank: int, port: int, spool: str) -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    # Two pipelines of two stages (ranks 0, 1 and 2, 3) made with plain groups, as PyTorch's
    # pipelining docs make a stage (their example passes the default group; with data parallelism
    # beside it, each pipeline is a group of its own). Every rank makes every group, in one order.
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    index = rank % 2
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    module = layers[:2] if index == 0 else layers[2:]
    stage = PipelineStage(module, index, 2, torch.device("cpu"), group=pipelines[rank // 2])
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=torch.nn.functional.mse_loss)
    # The hook attached at the loop, after the stage was made, as the README shows.
    hook = profiler_hook.attach(job="pipeline", spool_dir=spool, rank=rank, world_size=4, window_s=0)
    for _ in range(3):
        with hook.step():
            if index == 0:
                schedule.step(torch.randn(8, 16))
            else:
                schedule.step(target=torch.randn(8, 4))
    hook.close()
    dist.destroy_process_group()


def bound_before_attach_job(rank: int, port: int, spool: str) -> None:
    """Rank 1 is 30 ms late to every step's collective, which the loop calls through names bound
    before the hook is attached (``from torch.distributed import all_reduce`` at a script's top):
    a blocking all-reduce (steps 0-5), and the process group's own method, waited on (6-11).
    Steps 12-17 launch an asynchronous all-reduce through the patched function and wait on its
    work: timed from launch to completion, and its wait not once more."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    all_reduce, world = dist.all_reduce, dist.distributed_c10d._get_default_group()
    hook = profiler_hook.attach(
        job="bound", spool_dir=spool, rank=rank, world_size=2, window_s=0, step_block_s=0
    )
    t = torch.zeros(1024)
    for step in range(18):
        with hook.step():
            if rank == 1:
                time.sleep(0.03)
            if step < 6:
                all_reduce(t)
            elif step < 12:
                world.allreduce([t]).wait()
            else:
                dist.all_reduce(t, async_op=True).wait()
    hook.close()
    dist.destroy_process_group()


def send_recv_job(rank: int, port: int, spool: str, out: str, how: str) -> None:
    """Rank 1 sends rank 0 a tensor every step, 30 ms late (``P2P_STUCK_S`` at step ``STUCK_AT``);
    rank 0 waits for it in ``recv`` (``how`` = "call"), or in the work of an ``irecv`` given its
    peer as a rank of the default group, not as a global rank ("group_rank")."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    hook = profiler_hook.attach(
        job="sendrecv", spool_dir=spool, rank=rank, world_size=2, window_s=0, step_block_s=0,
        heartbeat_s=0.2, stall_s=1.0,
    )  # fmt: skip
    world = dist.distributed_c10d._get_default_group()
    before = world._get_sequence_number_for_group()
    t = torch.zeros(1024)
    for step in range(STUCK_AT + 1):
        with hook.step():
            if rank == 1:
                time.sleep(P2P_STUCK_S if step == STUCK_AT else 0.03)
            if how == "group_rank":
                work = dist.isend(t, group_dst=0) if rank == 1 else dist.irecv(t, group_src=1)
                work.wait()
            elif rank == 1:
                dist.send(t, dst=0)
            else:
                dist.recv(t, src=1)
    Path(out, f"rank{rank}").write_text(f"{before} {world._get_sequence_number_for_group()}")
    hook.close()
    dist.destroy_process_group()
