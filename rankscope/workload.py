"""A real data-parallel training job on CPU/gloo, with faults that can be injected into one rank.

Used by ``rankscope demo``, the overhead benchmark and the fault suite. Each rank trains the same
MLP on its shard of a synthetic classification set through a real DataLoader: forward, backward,
an all-reduce of the gradients, an optimizer step — the loop a DDP job runs, written out so that
the collective is a plain ``torch.distributed.all_reduce`` the hook can sequence.

Faults (only on ``Fault.rank``):

``compute``     a slow device: every layer processes ``factor``× as many rows (the real batch plus
                zero padding that is sliced off again), so the same operators take longer.
``dataloader``  slow storage: each batch fetch waits ``delay_ms`` more.
``code_path``   the rank runs an extra Python function every step (a gradient audit).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

FAULTS = ("none", "compute", "dataloader", "code_path")


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    kind: str = "none"
    rank: int = 2
    factor: float = 2.0
    """compute: how many times more work each layer does on the faulty rank."""
    delay_ms: float = 15.0
    """dataloader: extra wait per batch on the faulty rank."""
    audit_rounds: int = 12
    """code_path: how many times the extra function walks the gradients per step."""

    def __post_init__(self) -> None:
        if self.kind not in FAULTS:
            raise ValueError(f"unknown fault {self.kind!r}; choose one of {', '.join(FAULTS)}")
        if self.factor < 1:
            raise ValueError(f"Fault.factor must be >= 1, got {self.factor}")

    def on(self, rank: int) -> str:
        return self.kind if rank == self.rank else "none"


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    job: str
    world_size: int = 4
    port: int = 29500
    seconds: float = 60.0
    """Rank 0 ends the job at the first step after this many seconds (all ranks stop together)."""
    max_steps: int = 0
    """If > 0, stop after this many steps instead."""
    fault: Fault = field(default_factory=Fault)
    hosts: int = 2
    """Ranks are spread over this many simulated hosts (``node0``, ``node1``, ...)."""
    hook: dict[str, Any] | None = field(default_factory=dict)
    """profiler_hook.Config settings; None runs without the hook."""
    hook_blocks: int = 0
    """If > 0, the hook works only in even blocks of this many steps (an A/B inside one run)."""
    log_dir: str = ""
    """If set, each rank's stderr goes to ``<log_dir>/rank<R>.log``."""
    progress: bool = True
    batch_size: int = 64
    hidden: int = 512


def host_of(rank: int, spec: JobSpec) -> str:
    per_host = max(1, -(-spec.world_size // max(1, spec.hosts)))
    return f"node{rank // per_host}"


def _model(hidden: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(128, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def slow_device_forward(model: Any, x: Any, factor: float) -> Any:
    """Run ``model`` on ``x`` as a device ``factor``× slower would: same operators, more work each."""
    import torch

    extra = round(x.shape[0] * (factor - 1))
    padded = torch.cat([x, x.new_zeros((extra, x.shape[1]))])
    return model(padded)[: x.shape[0]]


def audit_gradients(model: Any, rounds: int) -> float:
    """The code-path fault: a debugging helper left on one rank that walks every gradient."""
    total = 0.0
    for _ in range(rounds):
        for p in model.parameters():
            g = p.grad
            total += float(g.abs().max()) + float(g.norm())
    return total


class _SlowCollate:
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __call__(self, batch: list) -> Any:
        from torch.utils.data import default_collate

        if self.delay_s:
            time.sleep(self.delay_s)  # slow storage: the fetch waits, the CPU is idle
        return default_collate(batch)


def run_rank(rank: int, spec: JobSpec) -> dict[str, Any]:
    """Train on one rank until the job ends; returns the rank's step count and hook counters."""
    if spec.log_dir:
        os.makedirs(spec.log_dir, exist_ok=True)
        fd = os.open(os.path.join(spec.log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 2)
    os.environ["RANKSCOPE_HOST"] = host_of(rank, spec)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{spec.port}", rank=rank, world_size=spec.world_size
    )
    hook = None
    if spec.hook is not None:
        import profiler_hook

        hook = profiler_hook.attach(job=spec.job, rank=rank, world_size=spec.world_size, **spec.hook)
    fault = spec.fault.on(rank)
    stats: dict[str, Any] = {"rank": rank}
    try:
        stats.update(_train(rank, spec, hook, fault))
    finally:
        if hook is not None:
            hook.close()
            stats.update(sent=hook.shipper.sent, dropped=hook.shipper.dropped)
        dist.destroy_process_group()
    return stats


def _train(rank: int, spec: JobSpec, hook: Any, fault: str) -> dict[str, Any]:
    """The training loop; returns the step count and step times as measured outside the hook."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(8192, 128, generator=g), torch.randint(0, 10, (8192,), generator=g))
    sampler: DistributedSampler = DistributedSampler(data, num_replicas=spec.world_size, rank=rank, seed=0)
    delay = spec.fault.delay_ms / 1e3 if fault == "dataloader" else 0.0
    loader = DataLoader(data, batch_size=spec.batch_size, sampler=sampler, collate_fn=_SlowCollate(delay))
    model = _model(spec.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    params = list(model.parameters())
    start = last_print = time.perf_counter()
    step, epoch, stop = 0, 0, False
    step_s: list[float] = []
    while not stop:
        sampler.set_epoch(epoch)
        batches = hook.wrap_loader(loader) if hook is not None else loader
        for x, y in batches:
            active = hook is not None and (not spec.hook_blocks or (step // spec.hook_blocks) % 2 == 0)
            if active:
                hook.begin_step(step)
            # Every rank takes the same code path; only the faulty one pads (does more work).
            out = slow_device_forward(model, x, spec.fault.factor if fault == "compute" else 1.0)
            loss = torch.nn.functional.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            if fault == "code_path":
                audit_gradients(model, spec.fault.audit_rounds)
            stop = _all_reduce_gradients(params, spec, step, start, rank)
            opt.step()
            if active:
                hook.end_step()
            step += 1
            now = time.perf_counter()
            step_s.append(now)
            if spec.progress and rank == 0 and (now - last_print >= 5 or stop):
                print(f"  step {step:5d}  {now - start:5.1f}s  loss {loss.item():.3f}", flush=True)
                last_print = now
            if stop:
                break
        epoch += 1
    dist.barrier()
    each = [b - a for a, b in zip([start, *step_s[:-1]], step_s, strict=True)]
    durations = sorted(each)
    result: dict[str, Any] = {
        "steps": step,
        "train_s": step_s[-1] - start if step_s else 0.0,
        "median_step_ms": 1e3 * durations[len(durations) // 2] if durations else 0.0,
    }
    if spec.hook_blocks:
        # Mean time per step with the hook working vs. idle, leaving out each block's first step.
        for name, parity in (("on_ms", 0), ("off_ms", 1)):
            sel = [
                d
                for i, d in enumerate(each)
                if (i // spec.hook_blocks) % 2 == parity and i % spec.hook_blocks
            ]
            result[name] = 1e3 * sum(sel) / max(len(sel), 1)
    return result


def _all_reduce_gradients(params: list, spec: JobSpec, step: int, start: float, rank: int) -> bool:
    """Average gradients across ranks; the extra last element carries rank 0's stop decision."""
    import torch
    import torch.distributed as dist

    flat = torch.cat([p.grad.reshape(-1) for p in params] + [torch.zeros(1)])
    if rank == 0:
        done = spec.max_steps > 0 and step + 1 >= spec.max_steps
        done = done or (spec.max_steps <= 0 and time.perf_counter() - start >= spec.seconds)
        flat[-1] = float(done)
    dist.all_reduce(flat)
    flat /= spec.world_size
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n
    return bool(flat[-1] > 0)


def _entry(rank: int, spec_dict: dict[str, Any], results: Any) -> None:
    spec = JobSpec(**{**spec_dict, "fault": Fault(**spec_dict["fault"])})
    results.put(run_rank(rank, spec))


def launch(spec: JobSpec) -> list[dict[str, Any]]:
    """Run the job's ranks as spawned processes; returns each rank's stats, by rank."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_entry, args=(asdict(spec), results), nprocs=spec.world_size, start_method="spawn")
    out = [results.get() for _ in range(spec.world_size)]
    return sorted(out, key=lambda r: r["rank"])


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":  # quick manual run: python -m rankscope.workload [fault] [seconds]
    kind = sys.argv[1] if len(sys.argv) > 1 else "none"
    secs = float(sys.argv[2]) if len(sys.argv) > 2 else 10
    stats = launch(JobSpec(job="manual", port=free_port(), seconds=secs, fault=Fault(kind=kind), hook=None))
    print(stats)
