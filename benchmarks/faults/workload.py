"""A real data-parallel training job on CPU/gloo, with faults that can be injected into one rank.

The fault suite's job (``rankscope demo`` runs ``rankscope/demo_job.py``, a user-style script). Each rank trains the same MLP on its shard of a
synthetic classification set through a real DataLoader: forward, backward, gradients averaged
over the ranks, an optimizer step. ``JobSpec.loop`` picks how gradients are averaged: a
hand-written ``torch.distributed.all_reduce`` (``manual``), DDP (the default) or FSDP2.

Its faults live in its code (``catalogue.Fault`` says which); ``launch`` runs it.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .catalogue import Fault, JobSpec, host_of, switch_of


class FaultClock:
    """Whether the rank's fault is active at a step: after the onset, in the on-phase of a pattern."""

    def __init__(self, fault: Fault, kind: str, rank: int, marker_dir: str) -> None:
        self.fault, self.kind, self.rank, self.marker_dir = fault, kind, rank, marker_dir
        self.onset = fault.onset_step if fault.onset_s < 0 else -1
        self.step = 0
        """The step being prepared or run (the data loader fetches its batch before it begins)."""
        self._marked = False

    def start_at(self, step: int) -> None:
        """Rank 0 said the onset time has passed: the fault starts at ``step``."""
        if self.onset < 0:
            self.onset = step

    def active(self, step: int | None = None) -> bool:
        step = self.step if step is None else step
        if self.kind == "none" or self.onset < 0 or step < self.onset:
            return False
        f = self.fault
        if f.on_steps > 0 and (step - self.onset) % (f.on_steps + f.off_steps) >= f.on_steps:
            return False
        if not self._marked:
            self._marked = True
            self._mark(step)
        return True

    def _mark(self, step: int) -> None:
        if not self.marker_dir:
            return
        path = os.path.join(self.marker_dir, f"onset-r{self.rank}")
        with open(path + ".tmp", "w") as fh:
            json.dump({"time": time.time(), "step": step, "rank": self.rank, "kind": self.kind}, fh)
        os.replace(path + ".tmp", path)  # readers never see a half-written marker


def _join_netns(name: str) -> None:
    """Move this process into network namespace ``name`` (as ``ip netns exec`` does)."""
    import ctypes

    clone_newnet = 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, clone_newnet) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name!r} failed: {os.strerror(err)}")
    finally:
        os.close(fd)


def stuck_in_python(deadline: float) -> int:
    """The Python-function hang: a retry loop that never succeeds (spins on the CPU)."""
    n = 0
    while time.time() < deadline:
        n += sum(range(1000)) % 7
    return n


def _block(deadline: float) -> None:
    """Block until ``deadline`` (the hang; the suite stops the job long before)."""
    while time.time() < deadline:
        time.sleep(0.5)


HANG_S = 3600.0
"""A hang lasts this long unless the job is stopped first."""


def model_of(hidden: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(128, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def slow_device_forward(model: Any, x: Any, extra: int) -> Any:
    """Run ``model`` on ``x`` plus ``extra`` zero rows, sliced off again: same operators, more work.

    Every rank pads (with 0 rows where its device is healthy), so the slow one runs the very same
    calls as its peers, as a slow device does; padding only there made its ``cat`` look like a code
    path of its own."""
    import torch

    return model(torch.cat([x, x.new_zeros((max(extra, 0), x.shape[1]))]))[: x.shape[0]]


def padding_rows(model: Any, x: Any, factor: float, reps: int = 11, rounds: int = 5) -> int:
    """Zero rows to add to batch ``x`` so that forward and backward take ``factor``x as long.

    What a device ``factor``x slower does to every operator. Padding by ``factor - 1`` of the batch
    falls short: each operator also has a fixed cost (here 15% more rows made forward and backward
    1.13x slower, twice the rows 1.75x), and the cost per row is not constant either. So the
    padding is found by timing: a few rounds of forward + backward with and without it,
    interleaved, on the job's real load, each round scaling the padding by what was missing; the
    median of the rounds' answers is used. Within ~10% of ``factor`` on this machine's noise.
    """
    if factor <= 1:
        return 0
    extra = naive = max(1, round(x.shape[0] * (factor - 1)))
    found = []
    for _ in range(rounds):
        times: dict[int, list[float]] = {0: [], extra: []}
        for _ in range(reps):
            for rows, t in times.items():
                t0 = time.perf_counter()
                slow_device_forward(model, x, rows).sum().backward()
                t.append(time.perf_counter() - t0)
        base, padded = (sorted(t)[reps // 2] for t in times.values())
        if padded <= base:  # timing noise: keep the padding as it is
            continue
        extra = max(1, round(extra * (factor - 1) / (padded / base - 1)))
        found.append(extra)
    model.zero_grad(set_to_none=True)
    picks = sorted(found[1:] or found) or [extra]  # the first round's guess is the roughest
    # Never below ``factor - 1`` of the batch, which falls short, never over. On busy shared cores
    # the timed rounds are noisy, and a round that measures too much slowdown scales the padding
    # down (a 1.8x job-wide fault once left the job's step time unchanged).
    return max(naive, picks[len(picks) // 2])


def _calibrate(plain: Any, x: Any, spec: JobSpec, fault: str) -> int:
    """The padding rows of a compute or job-wide fault, found before the first step.

    Every rank calibrates at once (the load the job will run under) and only the faulty ones keep
    the answer; on the plain module, since DDP's would all-reduce. Doing it before training keeps
    the harness's own timing runs out of the measured steps: a degraded device runs no extra code.
    """
    import torch
    import torch.distributed as dist

    if spec.fault.kind != "job_wide" and "compute" not in (spec.fault.kind, spec.fault.also):
        return 0
    rows = padding_rows(plain, x, spec.fault.factor)
    if spec.fault.kind == "job_wide":  # one bad library everywhere: the same slowdown on every rank
        total = torch.tensor([float(rows)])
        dist.all_reduce(total)
        rows = round(total.item() / spec.world_size)
    return rows if fault in ("compute", "job_wide") else 0


def inspect_gradient(grad: Any, rounds: int) -> None:
    """The grad_hook fault: a debugging hook left on one rank's parameters that inspects every
    gradient as backward produces it."""
    for _ in range(rounds):
        float(grad.abs().max()) + float(grad.norm())


def upload_metrics(step: int, loss: Any, block_ms: float) -> None:
    """The callback fault: a step callback that reports metrics synchronously (an HTTP call that
    blocks for ``block_ms`` on the faulty rank: a slow endpoint or a congested route)."""
    record = {"step": step, "loss": float(loss.detach())}
    if block_ms > 0:
        time.sleep(block_ms / 1e3)
    del record


def free_memory() -> int:
    """The gc fault: a memory clean-up that forces a full garbage collection."""
    import gc

    return gc.collect()


def rank0_duties(step: int, loss: Any, model: Any, opt: Any, held_out: list) -> None:
    """What rank 0 of a typical script does besides training: log, evaluate, checkpoint."""
    import io

    import torch

    if step % 10 == 0:
        print(f"step {step} loss {float(loss.detach()):.4f}", file=sys.stderr, flush=True)
    if step % 50 == 0:
        with torch.no_grad():
            model.eval()
            for _ in range(3):
                x = torch.stack([x for x, _ in held_out])
                y = torch.stack([y for _, y in held_out])
                torch.nn.functional.cross_entropy(model(x), y)
            model.train()
    if step % 100 == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, io.BytesIO())


def save_checkpoint(model: Any, deadline: float) -> None:
    """The checkpoint hang: the state is serialized, then the write waits on storage that never
    answers (an NFS mount gone away)."""
    import io

    import torch

    torch.save(model.state_dict(), io.BytesIO())
    threading.Event().wait(deadline - time.time())  # the write's completion, which never comes


def audit_gradients(model: Any, rounds: int) -> float:
    """The code-path fault: a debugging helper left on one rank that walks every gradient."""
    total = 0.0
    for _ in range(rounds):
        for p in model.parameters():
            g = p.grad
            total += float(g.abs().max()) + float(g.norm())
    return total


class ShardReader:
    """The job's dataset (map-style): samples come from storage a batch at a time (``__getitems__``,
    which the DataLoader calls with a batch's indices). The dataloader faults live in its read."""

    def __init__(self, x: Any, y: Any, delay_s: float, clock: FaultClock) -> None:
        self.x, self.y, self.delay_s, self.clock = x, y, delay_s, clock

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> list[tuple[Any, Any]]:
        self.read_from_storage()
        return [(self.x[i], self.y[i]) for i in indices]

    def read_from_storage(self) -> None:
        clock = self.clock
        if clock.kind == "dataloader" and clock.active():
            if (clock.step - clock.onset) % clock.fault.stall_every == 0:
                time.sleep(self.delay_s)  # slow storage: the fetch waits, the CPU is idle
        elif clock.kind == "hang" and clock.fault.hang_at == "dataloader" and clock.active():
            threading.Event().wait(HANG_S)  # a read from storage that never returns


def run_rank(rank: int, spec: JobSpec) -> dict[str, Any]:
    """Train on one rank until the job ends; returns the rank's step count and hook counters."""
    if spec.log_dir:
        os.makedirs(spec.log_dir, exist_ok=True)
        fd = os.open(os.path.join(spec.log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 2)
    os.environ["RANKSCOPE_HOST"] = host_of(rank, spec)
    if spec.switches:
        os.environ["RANKSCOPE_SWITCH"] = switch_of(rank, spec)
    if rank in spec.netns:
        _join_netns(spec.netns[rank])
    if rank in spec.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = spec.ifname[rank]
    if rank in spec.pin_cpu:
        os.sched_setaffinity(0, {spec.pin_cpu[rank]})
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    extra: dict[str, Any] = {}
    if spec.timeout_s > 0:
        extra["timeout"] = datetime.timedelta(seconds=spec.timeout_s)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{spec.master_addr}:{spec.port}",
        rank=rank,
        world_size=spec.world_size,
        **extra,
    )
    hooks: list[Any] = []

    def attach() -> Any:
        if spec.hook is None:
            return None
        from rankscope import profiler_hook

        hooks.append(profiler_hook.attach(job=spec.job, rank=rank, world_size=spec.world_size, **spec.hook))
        return hooks[-1]

    fault = spec.fault.on(rank)
    stats: dict[str, Any] = {"rank": rank}
    try:
        stats.update(_train(rank, spec, attach, fault))
    finally:
        for hook in hooks:
            hook.close()
            stats.update(sent=hook.shipper.sent, dropped=hook.shipper.dropped)
        dist.destroy_process_group()
    return stats


def _train(rank: int, spec: JobSpec, attach: Callable[[], Any], fault: str) -> dict[str, Any]:
    """The training loop; returns the step count and step times as measured outside the hook."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    hook: Any = attach() if spec.attach == "start" else None

    g = torch.Generator().manual_seed(1)
    clock = FaultClock(spec.fault, fault, rank, spec.marker_dir)
    data = ShardReader(
        torch.randn(8192, 128, generator=g),
        torch.randint(0, 10, (8192,), generator=g),
        spec.fault.delay_ms / 1e3 if fault == "dataloader" else 0.0,
        clock,
    )
    sampler: DistributedSampler = DistributedSampler(data, num_replicas=spec.world_size, rank=rank, seed=0)  # type: ignore[arg-type]
    loader: DataLoader = DataLoader(data, batch_size=spec.batch_size, sampler=sampler)  # type: ignore[arg-type]
    model = plain = model_of(spec.hidden)
    if spec.loop == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(plain)
    elif spec.loop == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in plain:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(plain)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if spec.attach == "loop":
        hook = attach()
    params = list(model.parameters())
    padding = _calibrate(plain, next(iter(loader))[0], spec, fault)
    callbacks = "callback" in (spec.fault.kind, spec.fault.also)
    held_out = [data[i] for i in range(spec.batch_size)] if spec.rank0_duties else []
    hooked: list[Any] = []
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
            faulty = clock.active(step)
            if faulty and fault == "grad_hook" and not hooked:
                inspect = functools.partial(inspect_gradient, rounds=spec.fault.audit_rounds)
                hooked = [p.register_hook(inspect) for p in plain.parameters()]
            # Every rank takes the same code path; only the faulty one pads (does more work).
            out = slow_device_forward(model, x, padding if faulty else 0)
            loss = torch.nn.functional.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            if faulty and fault == "code_path":
                audit_gradients(model, spec.fault.audit_rounds)
            if faulty and fault == "gc" and (step - clock.onset) % spec.fault.gc_every == 0:
                free_memory()
            if callbacks:  # every rank reports its metrics; the faulty one's upload blocks
                upload_metrics(step, loss, spec.fault.block_ms if faulty and fault == "callback" else 0.0)
            if faulty and fault == "hang":
                if spec.fault.hang_at == "python":
                    stuck_in_python(time.time() + HANG_S)
                elif spec.fault.hang_at == "collective":
                    _block(time.time() + HANG_S)  # e.g. waiting on a lock another thread never frees
                elif spec.fault.hang_at == "checkpoint":
                    save_checkpoint(plain, time.time() + HANG_S)
            if spec.loop == "manual":
                stop, onset = _all_reduce_gradients(params, spec, step, start, rank)
            else:  # gradients are already averaged; rank 0's decisions ride a small all-reduce
                stop, onset = _decisions(torch.zeros(2), spec, step, start, rank)
            if onset:
                clock.start_at(step + 1)
            opt.step()
            if active:
                hook.end_step()
            step += 1
            clock.step = step
            now = time.perf_counter()
            step_s.append(now)
            if spec.rank0_duties and rank == 0:
                rank0_duties(step, loss, plain, opt, held_out)
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


def _all_reduce_gradients(
    params: list, spec: JobSpec, step: int, start: float, rank: int
) -> tuple[bool, bool]:
    """Average gradients across ranks; two extra elements carry rank 0's stop and onset decisions."""
    import torch

    flat = torch.cat([p.grad.reshape(-1) for p in params] + [torch.zeros(2)])
    stop, onset = _decisions(flat, spec, step, start, rank)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n
    return stop, onset


def _decisions(flat: Any, spec: JobSpec, step: int, start: float, rank: int) -> tuple[bool, bool]:
    """All-reduce ``flat`` (averaged in place); its last two elements carry rank 0's stop and onset."""
    import torch.distributed as dist

    if rank == 0:
        elapsed = time.perf_counter() - start
        done = spec.max_steps > 0 and step + 1 >= spec.max_steps
        done = done or (spec.max_steps <= 0 and elapsed >= spec.seconds)
        flat[-1] = float(done)
        flat[-2] = float(0 <= spec.fault.onset_s <= elapsed)
    dist.all_reduce(flat)
    flat /= spec.world_size
    return bool(flat[-1] > 0), bool(flat[-2] > 0)
