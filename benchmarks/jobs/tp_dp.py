"""A 2-D parallel training script written the way PyTorch's tensor-parallel tutorial and
pytorch/torchtitan write one: a ``DeviceMesh`` of data-parallel × tensor-parallel ranks, each
transformer block's attention and feed-forward projections sharded over ``tp`` by
``parallelize_module`` (``ColwiseParallel`` in, ``RowwiseParallel`` out, the norms sequence
parallel), then each block and the model sharded with FSDP2 over ``dp``. rankscope's hook is
attached just before the loop, as its README shows.

    RANKSCOPE_SPOOL=/tmp/spool torchrun --nproc-per-node 4 benchmarks/jobs/tp_dp.py --steps 300

4 ranks on CPU (gloo) as a (dp=2, tp=2) mesh: ranks 0 and 1 are one tensor-parallel group, 2 and 3
the other; ranks 0 and 2, and 1 and 3, shard their parameters between them. The two ranks of a
tensor-parallel group do the same work on the same batch, and every block's forward and backward
waits for both (DTensor's all-reduces and all-gathers, launched from C++ by functional
collectives). The data is synthetic tokens, one batch per tensor-parallel group.

It trains ``--steps`` steps, or for ``--seconds`` (rank 0's clock) when that comes first, and rank
0 prints ``train: <steps> steps in <s> s (<ms> ms/step)`` for the training loop alone.

Faults, for rankscope's fault suite (only on ``--fault-rank``, from ``--onset-s`` seconds into
training, as ``job_parts.py`` has them): ``slow_backward`` (a slower device: the attention over
the rank's heads and the projections into it and into the feed-forward do ``--fault-factor``
times the work, forward and backward), ``metrics_block`` (``upload_metrics()`` blocks
``--fault-ms`` every step) and ``hang_checkpoint`` (``save_checkpoint()`` never returns).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from job_parts import Clock, Fault, arguments, loss_fn, more_rows, token_batches
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from rankscope import profiler_hook


def parse_args() -> argparse.Namespace:
    return arguments(__doc__.split("\n\n")[0], seq_len=128, dim=128, n_layers=2).parse_args()


# --- model (torchtitan's Llama layout) -------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    work_factor = 1.0
    """Fault injection (``slow_backward``): above 1, a slower device. The attention over this
    rank's heads and its projections into it run on the batch plus copies of its rows, forward and
    backward, so that they do this many times the work, and are sliced back: the same operators,
    each slower. (The projections out, whose collectives need the tensor-parallel group's shapes,
    keep theirs.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        rows = more_rows(b, self.work_factor)
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q, k, v = (
            project(w, x, rows).view(len(rows), t, -1, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:b]
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)
        self.w3 = nn.Linear(dim, 4 * dim, bias=False)

    work_factor = 1.0
    """Fault injection, as ``Attention.work_factor``: the projections in."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = more_rows(x.shape[0], self.work_factor)
        h = F.silu(project(self.w1, x, rows)) * project(self.w3, x, rows)
        return self.w2(h[: x.shape[0]] if len(rows) > x.shape[0] else h)


def project(linear: nn.Linear, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` for the batch's ``rows`` (``more_rows``). Beyond the batch, on this rank's
    shards as a column-wise parallel projection multiplies them (input replicated, output local),
    without going through the module: its output is the same, and no other collective runs."""
    if len(rows) == x.shape[0]:
        return linear(x)
    weight = linear.weight
    if isinstance(weight, DTensor):  # its input replicated, whose gradient is then a partial sum
        x = x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) else x
        weight = weight.to_local()
    return F.linear(x[rows], weight)


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
    def __init__(self, vocab: int, seq_len: int, dim: int, n_heads: int, n_layers: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos_embeddings = nn.Embedding(seq_len, dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, n_heads) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def block_plan() -> dict[str, ParallelStyle]:
    """torchtitan's plan for each block: the projections into attention and the feed-forward
    column-wise, the ones out of them row-wise, the norms sequence parallel in between. A block
    takes and gives the sequence sharded over tp, as local tensors."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def apply_tp(model: Transformer, tp_mesh: object) -> None:
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan())  # type: ignore[arg-type]
    # The blocks take and give the sequence sharded over tp; the embeddings and the head stay whole.
    parallelize_module(
        model,
        tp_mesh,  # type: ignore[arg-type]
        {
            "layers.0": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
            ),
            "norm": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
        },
    )


# --- training --------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    if args.steps <= 0 and args.seconds <= 0:
        raise SystemExit("say how long to train: --steps or --seconds")
    torch.set_num_threads(1)
    world_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_mesh, tp_mesh = world_mesh["dp"], world_mesh["tp"]
    rank, dp_rank = dist.get_rank(), dp_mesh.get_local_rank()

    torch.manual_seed(0)  # one initialization on every rank
    model = Transformer(args.vocab, args.seq_len, args.dim, args.n_heads, args.n_layers)
    apply_tp(model, tp_mesh)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    if rank == 0:
        print(
            f"rank 0: mesh {world_mesh.mesh.tolist()} {world_mesh.mesh_dim_names}, "
            f"tp group {tp_mesh.mesh.tolist()}, dp group {dp_mesh.mesh.tolist()}",
            flush=True,
        )

    get_batch = token_batches(args, dp_rank)  # both ranks of a tensor-parallel group draw the same batches

    hook = profiler_hook.attach(job=args.job)
    step, clock = 0, Clock(args)
    fault = Fault(args, clock, f"tp-dp{dp_rank}-r{rank}.pt")
    while step < args.steps or args.steps <= 0:
        with hook.step(step):
            if fault.begins(step) and fault.kind == "slow_backward":
                for m in model.modules():
                    if isinstance(m, (Attention, FeedForward)):
                        m.work_factor = args.fault_factor
            inputs, targets = get_batch()
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            fault.after_step(step, model, loss)
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
        raise SystemExit("run it under torchrun: torchrun --nproc-per-node 4 benchmarks/jobs/tp_dp.py")
    main()
