"""A data × pipeline parallel training script written the way DeepSpeed's pipeline docs write one:
the model as a ``PipelineModule`` of ``LayerSpec`` s (token embeddings, transformer blocks, the
final norm and the loss head) over 2 stages, ``deepspeed.initialize`` with a client optimizer,
and ``engine.train_batch(data_iter)`` for each step, which runs DeepSpeed's 1F1B schedule over the
microbatches and the data-parallel all-reduce. rankscope's hook is attached just before the loop,
as its README shows.

    RANKSCOPE_SPOOL=/tmp/spool torchrun --nproc-per-node 4 benchmarks/jobs/deepspeed_pipe.py --steps 300

4 ranks on CPU (gloo; DeepSpeed's CPU accelerator). DeepSpeed lays ranks out pipe-major
(``PipeDataParallelTopology``): ranks 0 and 1 hold stage 0, ranks 2 and 3 stage 1, so the
pipelines are ranks 0 → 2 and 1 → 3, and ranks 0 and 1 (2 and 3) are data-parallel replicas of
their stage. No ``DeviceMesh``: DeepSpeed makes its own process groups. The blocks are
``pipeline_dp.py``'s (torchtitan's); the data is synthetic tokens, the same batches on both
stages of a pipeline.

It trains ``--steps`` steps, or for ``--seconds`` (rank 0's clock), and rank 0 prints
``train: <steps> steps in <s> s (<ms> ms/step)`` for the training loop alone. Faults as
``pipeline_dp.py`` has them: ``network``, ``slow_backward`` (the faulty rank's blocks do
``--fault-factor`` times the work), ``metrics_block``, ``hang_checkpoint``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule
from job_parts import Clock, Fault, arguments, loss_fn, more_rows, token_batches
from pipeline_dp import TransformerBlock
from torch import nn

from rankscope import profiler_hook


def parse_args() -> argparse.Namespace:
    ap = arguments(__doc__.split("\n\n")[0])
    ap.add_argument("--microbatches", type=int, default=4)
    return ap.parse_args()


class Embedding(nn.Module):
    def __init__(self, vocab: int, seq_len: int, dim: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos_embeddings = nn.Embedding(seq_len, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok_embeddings(tokens) + self.pos_embeddings(pos)


class Block(TransformerBlock):
    work_factor = 1.0
    """Fault injection (``slow_backward``): above 1, the block pads its microbatch with copies of
    its rows, so that it does this many times the work, and slices them off again."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if self.work_factor <= 1:
            return super().forward(x)
        return super().forward(x[more_rows(n, self.work_factor)])[:n]


class Head(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))


def main() -> None:
    args = parse_args()
    if args.steps <= 0 and args.seconds <= 0:
        raise SystemExit("say how long to train: --steps or --seconds")
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    layers = [
        LayerSpec(Embedding, args.vocab, args.seq_len, args.dim),
        *(LayerSpec(Block, args.dim, args.n_heads) for _ in range(args.n_layers)),
        LayerSpec(Head, args.vocab, args.dim),
    ]
    model = PipelineModule(layers=layers, loss_fn=loss_fn, num_stages=2, partition_method="type:Block")
    micro = max(1, args.batch_size // args.microbatches)
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": args.microbatches,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    rank, stage, dp_rank = dist.get_rank(), engine.stage_id, engine.grid.get_data_parallel_id()
    if rank == 0:
        print(
            f"rank 0: {engine.num_stages} stages, data parallel {engine.grid.get_data_parallel_world_size()}"
        )

    get_batch = token_batches(argparse.Namespace(**{**vars(args), "batch_size": micro}), dp_rank)

    def microbatches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield get_batch()

    data = microbatches()
    hook = profiler_hook.attach(job=args.job)
    step, clock = 0, Clock(args)
    fault = Fault(args, clock, f"deepspeed-stage{stage}-dp{dp_rank}.pt")
    while step < args.steps or args.steps <= 0:
        with hook.step(step):
            if fault.begins(step) and fault.kind == "slow_backward":
                for block in (m for m in engine.module.modules() if isinstance(m, Block)):
                    block.work_factor = args.fault_factor
            loss = engine.train_batch(data_iter=data)
            fault.after_step(step, engine.module)
        step += 1
        if rank == 0 and step % 50 == 0:
            print(f"step {step:5d}  loss {loss.item():.3f}", flush=True)
        if clock.stop_after(step):
            break
    clock.report(step)
    hook.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:
        raise SystemExit(
            "run it under torchrun: torchrun --nproc-per-node 4 benchmarks/jobs/deepspeed_pipe.py"
        )
    main()
