"""What the 2-D and 3-D parallel scripts (``pipeline_dp.py``, ``tp_dp.py``, ``pp_tp_dp.py``) share,
as a training repository keeps its loop's helpers apart from its models: the command line,
synthetic token batches, a pipeline schedule's step, the calls a fault blocks in (a metrics
upload, a checkpoint write), and rank 0's clock, which tells every rank at one step when to stop
and when the fault begins.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

FAULTS = ("none", "slow_backward", "metrics_block", "hang_checkpoint", "network")
"""``network``: the fault suite changes the network under the job at onset; the script only marks it."""


def arguments(description: str, **defaults: int) -> argparse.ArgumentParser:
    """The scripts' common options; ``defaults`` sets the model's sizes (``seq_len=64``...)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--steps", type=int, default=0, help="train this many steps (0: until --seconds)")
    ap.add_argument("--seconds", type=float, default=0.0, help="or stop after this long (0: no limit)")
    ap.add_argument("--job", default="", help="job id (default: $RANKSCOPE_JOB or torchrun's run id)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per step on each dp rank")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--fault", choices=FAULTS, default="none")
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--onset-s", type=float, default=10.0)
    ap.add_argument("--fault-ms", type=float, default=15.0, help="metrics_block: ms each upload blocks")
    ap.add_argument("--fault-factor", type=float, default=1.7, help="slow_backward: work factor")
    ap.add_argument("--marker-dir", default="", help="write the onset marker here")
    ap.add_argument("--ckpt-dir", default="", help="hang_checkpoint writes here (default: a temporary one)")
    ap.add_argument("--attach", choices=("loop",), default="loop", help="where the hook is attached")
    ap.set_defaults(**defaults)
    return ap


def token_batches(args: argparse.Namespace, dp_rank: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """Batches of synthetic tokens and their next tokens; the ranks of one replica (same
    ``dp_rank``) draw the same ones."""
    data = torch.randint(0, args.vocab, (200_000,), generator=torch.Generator().manual_seed(0))
    sampler = torch.Generator().manual_seed(1000 + dp_rank)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - args.seq_len - 1, (args.batch_size,), generator=sampler)
        x = torch.stack([data[i : i + args.seq_len] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + args.seq_len] for i in ix])
        return x, y

    return get_batch


def more_rows(b: int, work_factor: float) -> torch.Tensor:
    """The rows a slower device's operators run on (the faults' ``slow_backward``): the batch's
    ``b``, then copies of them up to ``work_factor`` times as many (just the batch at 1)."""
    return torch.arange(b if work_factor <= 1 else max(b + 1, round(b * work_factor))) % b


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def upload_metrics(metrics: dict, block_s: float) -> None:
    """A synchronous metrics call (fault: the endpoint answers only after ``block_s``)."""
    body = json.dumps(metrics).encode()
    time.sleep(block_s)  # waiting for the HTTP response
    del body


def save_checkpoint(model: nn.Module, path: str, storage: threading.Event) -> None:
    storage.wait()  # fault: the storage never acknowledges the write (a dead NFS server)
    torch.save(model.state_dict(), path)


def write_marker(marker_dir: str, rank: int, step: int, kind: str) -> None:
    path = os.path.join(marker_dir, f"onset-r{rank}")
    with open(path + ".tmp", "w") as fh:
        json.dump({"time": time.time(), "step": step, "rank": rank, "kind": kind}, fh)
    os.replace(path + ".tmp", path)


class Clock:
    """Rank 0's clock, shared through one small all-reduce a step (only where the run is timed or
    has a fault): every rank stops, and begins its fault, at the same step."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.rank = args, dist.get_rank()
        self.start = time.perf_counter()
        self.onset_step = -1

    def stop_after(self, step: int) -> bool:
        """Called after each step: whether to stop; sets ``onset_step`` the step the fault begins."""
        if self.args.seconds <= 0 and self.args.fault == "none":
            return False
        elapsed = time.perf_counter() - self.start
        first = self.rank == 0
        flags = torch.tensor(
            [float(first and 0 < self.args.seconds <= elapsed), float(first and self.args.onset_s <= elapsed)]
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[1] and self.onset_step < 0:
            self.onset_step = step
        return bool(flags[0])

    def report(self, steps: int) -> None:
        """Rank 0 prints ``train: <steps> steps in <s> s (<ms> ms/step)`` for the training loop alone."""
        took = time.perf_counter() - self.start
        if self.rank == 0:
            print(
                f"train: {steps} steps in {took:.2f} s ({1e3 * took / max(steps, 1):.2f} ms/step)", flush=True
            )


class Fault:
    """This rank's fault (``none`` unless it is ``--fault-rank``), from the step rank 0's clock
    says: :meth:`begins` at that step (writing the onset marker), then :meth:`after_step` blocks in
    the metrics upload or the checkpoint write (``ckpt_name`` in ``--ckpt-dir``) each step."""

    def __init__(self, args: argparse.Namespace, clock: Clock, ckpt_name: str) -> None:
        self.args, self.clock = args, clock
        self.kind = args.fault if clock.rank == args.fault_rank else "none"
        self.ckpt = os.path.join(args.ckpt_dir or tempfile.gettempdir(), ckpt_name)
        self._storage = threading.Event()  # never set: the checkpoint write never completes

    def on(self, step: int) -> bool:
        """Whether the fault is on at ``step``."""
        return self.kind != "none" and 0 <= self.clock.onset_step <= step

    def begins(self, step: int) -> bool:
        """Whether the fault begins at ``step``; its marker is then in ``--marker-dir``."""
        if not self.on(step) or step != self.clock.onset_step:
            return False
        if self.args.marker_dir:
            write_marker(self.args.marker_dir, self.clock.rank, step, self.kind)
        return True

    def after_step(self, step: int, model: nn.Module, loss: torch.Tensor | None = None) -> None:
        """The faulty calls a training loop makes after its step: ``upload_metrics`` (of the step,
        and its ``loss`` where given), ``save_checkpoint`` of ``model``."""
        if not self.on(step):
            return
        if self.kind == "metrics_block":
            metrics = {"step": step} if loss is None else {"step": step, "loss": loss.item()}
            upload_metrics(metrics, self.args.fault_ms / 1e3)
        elif self.kind == "hang_checkpoint":
            save_checkpoint(model, self.ckpt, self._storage)


def pipeline_step(
    schedule: Any, stage: Any, inputs: torch.Tensor, targets: torch.Tensor
) -> list[torch.Tensor] | None:
    """One step of a ``torch.distributed.pipelining`` schedule, as torchtitan's
    ``forward_backward_step`` takes it: the first stage feeds the inputs, the last computes the
    loss of every microbatch and returns them (the other stages: None)."""
    losses: list[torch.Tensor] | None = [] if stage.is_last else None
    if stage.is_first:
        schedule.step(inputs, target=targets, losses=losses)
    else:
        schedule.step(target=targets, losses=losses)
    return losses
