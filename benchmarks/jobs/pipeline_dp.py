"""A 2-D parallel training script written the way pytorch/torchtitan writes one: a ``DeviceMesh`` of
data-parallel × pipeline-parallel ranks, the model split into two pipeline stages by module name,
each stage's blocks and the stage itself sharded with FSDP2 over the ``dp`` dimension, and a 1F1B
schedule over microbatches on the ``pp`` dimension (``--schedule gpipe``: GPipe's, all forwards
then all backwards; ``--dp ddp``: the replicas kept whole, under DDP, as torchtitan's
``dp_replicate`` does). rankscope's hook is attached just before the loop, as its README shows.

    RANKSCOPE_SPOOL=/tmp/spool torchrun --nproc-per-node 4 benchmarks/jobs/pipeline_dp.py --steps 300

4 ranks on CPU (gloo) as a (dp=2, pp=2) mesh: ``init_device_mesh`` lays ranks out row-major, so
with ``mesh_dim_names=("dp", "pp")`` ranks 0 and 1 are one pipeline and 2 and 3 the other, and
ranks 0 and 2 (stage 0) and 1 and 3 (stage 1) shard their stage between them. Stage 0 holds the
token embeddings and the first half of the blocks; stage 1 the rest, the final norm and the loss
head: the stages differ in work by design. The data is synthetic tokens, the same batch on both
ranks of a pipeline (stage 0 reads its inputs, stage 1 its targets).

It trains ``--steps`` steps, or for ``--seconds`` (rank 0's clock; every rank stops at the same
step) when that comes first, and rank 0 prints ``train: <steps> steps in <s> s (<ms> ms/step)``
for the training loop alone.

Faults, for rankscope's fault suite, as ``rankscope/demo_job.py`` has them (only on
``--fault-rank``, from ``--onset-s`` seconds into training; rank 0 says when through the small
all-reduce that already tells every rank when to stop; ``--marker-dir`` gets ``onset-r<rank>``):
``network`` (nothing in the script: the suite slows a link at onset, the rank marks when),
``slow_backward`` (the rank's stage does ``--fault-factor`` times the work: its microbatches padded
with copies of their rows, sliced off again), ``metrics_block`` (``upload_metrics()`` blocks
``--fault-ms`` every step) and ``hang_checkpoint`` (``save_checkpoint()`` never returns).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from job_parts import Clock, Fault, arguments, loss_fn, more_rows, pipeline_step, token_batches
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from rankscope import profiler_hook


def parse_args() -> argparse.Namespace:
    ap = arguments(__doc__.split("\n\n")[0])
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b", help="the pipeline's schedule")
    ap.add_argument("--dp", choices=("fsdp", "ddp"), default="fsdp", help="over the replicas: FSDP2 or DDP")
    return ap.parse_args()


SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


# --- model -----------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_heads, -1).transpose(1, 2) for z in self.wqkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, c))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """torchtitan's layout: ``layers`` is a ModuleDict, so that a stage keeps its blocks' names,
    and ``forward`` passes over the parts a pipeline stage does not hold (None)."""

    def __init__(self, vocab: int, seq_len: int, dim: int, n_heads: int, n_layers: int) -> None:
        super().__init__()
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(vocab, dim)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(seq_len, dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, n_heads) for i in range(n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(dim)
        self.output: nn.Linear | None = nn.Linear(dim, vocab, bias=False)

    work_factor = 1.0
    """Fault injection (``slow_backward``): above 1, every microbatch is padded with copies of its
    rows, so that the stage does this many times the work, and sliced back."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[0]
        if self.work_factor > 1:
            tokens = tokens[more_rows(n, self.work_factor)]
        h = tokens
        if self.tok_embeddings is not None and self.pos_embeddings is not None:
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        out = self.output(h) if self.output is not None else h
        return out[:n].clone() if self.work_factor > 1 else out


def stage_modules(n_layers: int) -> list[list[str]]:
    """Module names per pipeline stage: the embeddings and the first half of the blocks, then the
    other half, the final norm and the loss head."""
    half = n_layers // 2
    return [
        ["tok_embeddings", "pos_embeddings", *(f"layers.{i}" for i in range(half))],
        [*(f"layers.{i}" for i in range(half, n_layers)), "norm", "output"],
    ]


def split_module(whole: Transformer, keep: list[str]) -> Transformer:
    """A copy of ``whole`` holding only the modules named in ``keep`` (torchtitan's split)."""
    model = copy.deepcopy(whole)
    for name in ("tok_embeddings", "pos_embeddings", "norm", "output"):
        if name not in keep:
            setattr(model, name, None)
    for layer_id in list(model.layers.keys()):
        if f"layers.{layer_id}" not in keep:
            del model.layers[layer_id]
    return model


# --- training --------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    if args.steps <= 0 and args.seconds <= 0:
        raise SystemExit("say how long to train: --steps or --seconds")
    torch.set_num_threads(1)
    world_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp_mesh, pp_mesh = world_mesh["dp"], world_mesh["pp"]
    rank = dist.get_rank()
    pp_rank, pp_size = pp_mesh.get_local_rank(), pp_mesh.size()
    dp_rank = dp_mesh.get_local_rank()

    torch.manual_seed(0)  # one initialization, then each stage keeps its part
    whole = Transformer(args.vocab, args.seq_len, args.dim, args.n_heads, args.n_layers)
    stage_idx = pp_rank
    model = split_module(whole, stage_modules(args.n_layers)[stage_idx])
    del whole
    if args.dp == "fsdp":
        # FSDP2 over the dp dimension: each block, then the stage's root. Under PP, torchtitan keeps
        # parameters gathered after forward, or every microbatch would all-gather them again.
        for block in model.layers.values():
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)
    else:  # the replicas kept whole under DDP, as torchtitan's apply_ddp does
        replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)
    stage = PipelineStage(model, stage_idx, pp_size, torch.device("cpu"), group=pp_mesh.get_group())
    schedule = SCHEDULES[args.schedule](stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    if rank == 0:
        print(
            f"rank 0: mesh {world_mesh.mesh.tolist()} {world_mesh.mesh_dim_names}, "
            f"pipeline {pp_mesh.mesh.tolist()}, dp group {dp_mesh.mesh.tolist()}",
            flush=True,
        )

    get_batch = token_batches(args, dp_rank)  # both ranks of a pipeline draw the same batches

    hook = profiler_hook.attach(job=args.job)
    step, clock = 0, Clock(args)
    fault = Fault(args, clock, f"pipeline-stage{stage_idx}-dp{dp_rank}.pt")
    while step < args.steps or args.steps <= 0:
        with hook.step(step):
            if fault.begins(step) and fault.kind == "slow_backward":
                model.work_factor = args.fault_factor
            inputs, targets = get_batch()
            optimizer.zero_grad()
            losses = pipeline_step(schedule, stage, inputs, targets)
            optimizer.step()
            fault.after_step(step, model)
        step += 1
        if rank == pp_size - 1 and losses and step % 50 == 0:
            print(f"step {step:5d}  loss {torch.stack(losses).mean().item():.3f}", flush=True)
        if clock.stop_after(step):
            break
    clock.report(step)
    hook.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:
        raise SystemExit("run it under torchrun: torchrun --nproc-per-node 4 benchmarks/jobs/pipeline_dp.py")
    main()
