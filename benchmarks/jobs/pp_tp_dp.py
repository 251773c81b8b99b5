"""A 3-D parallel training script written the way pytorch/torchtitan writes one: a ``DeviceMesh`` of
pipeline × data-parallel × tensor-parallel ranks (``pp`` outermost, ``tp`` innermost, as
torchtitan orders its mesh), the model split into two pipeline stages by module name, each
stage's blocks tensor-parallel over ``tp`` (``tp_dp.py``'s plan: ``ColwiseParallel`` in,
``RowwiseParallel`` out, the norms sequence parallel), then each block and the stage sharded with
FSDP2 over ``dp``, and a 1F1B schedule over microbatches on ``pp``. rankscope's hook is attached
just before the loop, as its README shows.

    RANKSCOPE_SPOOL=/tmp/spool torchrun --nproc-per-node 8 benchmarks/jobs/pp_tp_dp.py --steps 100

8 ranks on CPU (gloo) as a (pp=2, dp=2, tp=2) mesh: ranks 0-3 hold stage 0 and 4-7 stage 1; within
a stage, ranks 0 and 1 (2 and 3) are a tensor-parallel pair and 0 and 2 (1 and 3) shard their
parameters; the pipelines are ranks 0 → 4, 1 → 5, 2 → 6 and 3 → 7. Stage 0 holds the token
embeddings and the first half of the blocks; stage 1 the rest, the final norm and the loss head.
Between the stages travels what passes between two blocks: the sequence sharded over tp.
The data is synthetic tokens, the same batches for every rank of a data-parallel replica.

It trains ``--steps`` steps, or for ``--seconds`` (rank 0's clock), and rank 0 prints ``train:
<steps> steps in <s> s (<ms> ms/step)`` for the training loop alone. Faults as ``tp_dp.py`` has
them: ``slow_backward`` (a slower device: its attention and the projections into it and into the
feed-forward do ``--fault-factor`` times the work), ``metrics_block``, ``hang_checkpoint``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from job_parts import Clock, Fault, arguments, loss_fn, pipeline_step, token_batches
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module
from tp_dp import Attention, FeedForward, Transformer, block_plan

from rankscope import profiler_hook


def parse_args() -> argparse.Namespace:
    ap = arguments(__doc__.split("\n\n")[0], seq_len=128, dim=128, n_layers=4)  # tp_dp.py's sizes
    ap.add_argument("--microbatches", type=int, default=4)
    return ap.parse_args()


class Stage(nn.Module):
    """One pipeline stage of ``tp_dp.py``'s model (torchtitan's split: the blocks keep their names,
    the parts the stage does not hold are None)."""

    def __init__(self, whole: Transformer, index: int, stages: int) -> None:
        super().__init__()
        first, last = index == 0, index == stages - 1
        ids = list(whole.layers.keys())
        per = len(ids) // stages
        self.tok_embeddings = whole.tok_embeddings if first else None
        self.pos_embeddings = whole.pos_embeddings if first else None
        self.layers = nn.ModuleDict({i: whole.layers[i] for i in ids[index * per : (index + 1) * per]})
        self.norm = whole.norm if last else None
        self.output = whole.output if last else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None and self.pos_embeddings is not None:
            pos = torch.arange(h.shape[1], device=h.device)
            h = self.tok_embeddings(h) + self.pos_embeddings(pos)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None and self.output is not None:
            h = self.output(self.norm(h))
        return h


def apply_tp(stage: Stage, tp_mesh: object) -> None:
    """Each block as ``tp_dp.py`` plans it; the first stage shards the embeddings' output over the
    sequence into its first block, the last gathers it before the norm and the head."""
    for block in stage.layers.values():
        parallelize_module(block, tp_mesh, block_plan())  # type: ignore[arg-type]
    plan = {}
    if stage.tok_embeddings is not None:
        plan[f"layers.{next(iter(stage.layers))}"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
    if stage.norm is not None:
        plan["norm"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    parallelize_module(stage, tp_mesh, plan)  # type: ignore[arg-type]


def main() -> None:
    args = parse_args()
    if args.steps <= 0 and args.seconds <= 0:
        raise SystemExit("say how long to train: --steps or --seconds")
    torch.set_num_threads(1)
    world_mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp_mesh, dp_mesh, tp_mesh = world_mesh["pp"], world_mesh["dp"], world_mesh["tp"]
    rank, stage_idx, dp_rank = dist.get_rank(), pp_mesh.get_local_rank(), dp_mesh.get_local_rank()

    torch.manual_seed(0)  # one initialization, then each stage keeps its part
    model = Stage(Transformer(args.vocab, args.seq_len, args.dim, args.n_heads, args.n_layers), stage_idx, 2)
    apply_tp(model, tp_mesh)
    # FSDP2 over dp: each block, then the stage's root; gathered after forward under PP (torchtitan).
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)
    stage = PipelineStage(model, stage_idx, 2, torch.device("cpu"), group=pp_mesh.get_group())
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    if rank == 0:
        print(f"rank 0: mesh {world_mesh.mesh.tolist()} {world_mesh.mesh_dim_names}", flush=True)

    get_batch = token_batches(args, dp_rank)  # every rank of a replica draws the same batches

    hook = profiler_hook.attach(job=args.job)
    step, clock = 0, Clock(args)
    fault = Fault(args, clock, f"3d-r{rank}.pt")
    while step < args.steps or args.steps <= 0:
        with hook.step(step):
            if fault.begins(step) and fault.kind == "slow_backward":
                for m in model.modules():
                    if isinstance(m, (Attention, FeedForward)):
                        m.work_factor = args.fault_factor
            inputs, targets = get_batch()
            optimizer.zero_grad()
            losses = pipeline_step(schedule, stage, inputs, targets)
            optimizer.step()
            fault.after_step(step, model)
        step += 1
        if rank == dist.get_world_size() - 1 and losses and step % 50 == 0:
            print(f"step {step:5d}  loss {torch.stack(losses).mean().item():.3f}", flush=True)
        if clock.stop_after(step):
            break
    clock.report(step)
    hook.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:
        raise SystemExit("run it under torchrun: torchrun --nproc-per-node 8 benchmarks/jobs/pp_tp_dp.py")
    main()
