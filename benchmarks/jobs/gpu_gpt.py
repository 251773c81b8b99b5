"""A small GPT trained on a GPU the way such scripts are written: token and position embeddings,
pre-norm transformer blocks, bf16 autocast, fused AdamW, a ``DataLoader`` with pinned memory and
``non_blocking`` copies, the loss read (``loss.item()``) every 10th step as nanoGPT logs it, DDP.
``benchmarks.gpu_check`` runs it; it runs alone too:

    torchrun --nproc-per-node 1 benchmarks/jobs/gpu_gpt.py --backend nccl --seconds 20 --out run.json
    torchrun --nproc-per-node 4 benchmarks/jobs/gpu_gpt.py --backend gloo --fault stall --fault-rank 3

rankscope's hook is attached at its defaults (``--hook on``), before DDP as the README shows; not at
all (``--hook off``); or, after ``--ab-after-s`` seconds, worked and paused in alternating blocks of
``--ab-block-s`` (``--hook ab``: an A/B inside one run, each block's end synchronized with the GPU).

Faults, on ``--fault-rank`` from ``--onset-s`` seconds on (rank 0's clock, passed on with the
all-reduce that every 10th step makes anyway):

``stall``     the rank calls ``upload_metrics()`` every ``--every``-th step, a synchronous call
              that blocks ``--fault-ms`` on the CPU while its GPU idles.
``slow_gpu``  the rank's GPU is slower: under MPS (``--mps-pct``, set before CUDA starts, from the
              start) its kernels get that share of the SMs; without MPS its batch is padded with
              copies of its rows (``--fault-factor`` times the work: the same kernels, longer).
``hang``      the rank enters ``save_checkpoint()`` and never returns.

With ``--out`` rank 0 writes its measurements as JSON: ms per step after the warm-up (between two
GPU synchronizations), the time each window's start and stop took on the training thread, and
the A/B blocks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

# The slower GPU must be chosen before CUDA starts in this process.
_pre = argparse.ArgumentParser(add_help=False)
_pre.add_argument("--fault", default="none")
_pre.add_argument("--fault-rank", type=int, default=1)
_pre.add_argument("--mps-pct", type=int, default=0)
_early, _ = _pre.parse_known_args()
if _early.fault == "slow_gpu" and _early.mps_pct and int(os.environ.get("RANK", "0")) == _early.fault_rank:
    os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(_early.mps_pct)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from rankscope import profiler_hook  # noqa: E402
from rankscope.demo_job import GPT  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[_pre])
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-head", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hook", choices=("on", "off", "ab"), default="on")
    ap.add_argument("--ab-after-s", type=float, default=12.0)
    ap.add_argument("--ab-block-s", type=float, default=0.5)
    ap.add_argument("--onset-s", type=float, default=10.0)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--fault-ms", type=float, default=60.0)
    ap.add_argument("--fault-factor", type=float, default=1.5)
    ap.add_argument("--out", default="")
    return ap.parse_args()


class Tokens(Dataset):
    """Random token windows (a tokenized corpus would be read the same way)."""

    def __init__(self, vocab: int, seq_len: int, n: int = 4096) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (n + seq_len + 1,), generator=g)
        self.seq_len, self.n = seq_len, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.data[i : i + self.seq_len + 1]
        return x[:-1], x[1:]


def upload_metrics(ms: float) -> None:
    """A metrics endpoint answering slowly: the training thread waits."""
    time.sleep(ms / 1e3)


def save_checkpoint() -> None:
    """A checkpoint write waiting on storage that never answers."""
    while True:
        time.sleep(1.0)


def main() -> None:
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()  # without one (a smoke test of the script), on the CPU over gloo
    if cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(args.backend if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1337 + rank)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    hook = profiler_hook.attach() if args.hook != "off" else None
    model = DDP(GPT(args.vocab, args.seq_len, args.d_model, args.n_head, args.n_layer).to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda)
    loader = DataLoader(
        Tokens(args.vocab, args.seq_len),
        batch_size=args.batch_size,
        shuffle=True,
        pin_memory=cuda,
        drop_last=True,
    )
    slow_pad = args.fault == "slow_gpu" and not args.mps_pct and rank == args.fault_rank

    def train_step(x: torch.Tensor, y: torch.Tensor, faulty: bool) -> torch.Tensor:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if faulty and slow_pad:
            extra = max(1, round(x.shape[0] * (args.fault_factor - 1)))
            x, y = torch.cat([x, x[:extra]]), torch.cat([y, y[:extra]])
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    starts: list[float] = []  # seconds each window's start took on the training thread
    stops: list[float] = []
    blocks: list[dict[str, float]] = []
    step, faulty, t_begin, t_warm, warm_step = 0, False, time.time(), 0.0, 0
    working, block_t0, block_step, pair = True, 0.0, 0, 0

    def begin() -> None:
        if hook is None:
            return
        before = hook.window
        t = time.perf_counter()
        hook.begin_step()
        if before is None and hook.window is not None:
            starts.append(time.perf_counter() - t)

    def end() -> None:
        if hook is None:
            return
        before = hook.window
        t = time.perf_counter()
        hook.end_step()
        if before is not None and hook.window is None:
            stops.append(time.perf_counter() - t)

    done = False
    while not done:
        for x, y in loader:
            begin()
            loss = train_step(x, y, faulty)
            if faulty and args.fault == "stall" and step % args.every == 0:
                upload_metrics(args.fault_ms)
            end()
            step += 1
            if step == args.warmup_steps:
                sync()
                t_warm, warm_step = time.perf_counter(), step
            if step % 10:
                continue
            # Every 10th step: the loss, as nanoGPT logs it, and rank 0's clock for every rank.
            flags = torch.tensor(
                [loss.item(), time.time() - t_begin >= args.seconds, time.time() - t_begin >= args.onset_s],
                device=device,
            )
            if rank:
                flags[1:] = 0
            dist.all_reduce(flags)
            if flags[2] and not faulty and args.fault != "none" and rank == args.fault_rank:
                faulty = True
                if args.fault == "hang":
                    save_checkpoint()
            if flags[1]:
                done = True
                break
            if args.hook == "ab" and hook is not None and time.time() - t_begin >= args.ab_after_s:
                sync()
                now = time.perf_counter()
                if not block_t0:
                    block_t0, block_step = now, step
                elif now - block_t0 >= args.ab_block_s and hook.window is None:
                    blocks.append(
                        {"working": working, "s": now - block_t0, "steps": step - block_step, "pair": pair}
                    )
                    # Pairs alternate their order, so that drift hits both arms alike.
                    if len(blocks) % 2 == 0:
                        pair += 1
                        working = pair % 2 == 0
                    else:
                        working = not working
                    if working:
                        hook.resume()
                    else:
                        hook.pause()
                    block_t0, block_step = time.perf_counter(), step
    sync()
    elapsed, steps = time.perf_counter() - t_warm, step - warm_step
    if hook is not None:
        hook.resume()
        hook.close()
    if rank == 0 and args.out:
        on = [b["s"] / b["steps"] for b in blocks if b["working"]]
        off = [b["s"] / b["steps"] for b in blocks if not b["working"]]
        pairs = [
            (w["s"] / w["steps"]) / (p["s"] / p["steps"]) - 1
            for n in {b["pair"] for b in blocks}
            for w in [b for b in blocks if b["pair"] == n and b["working"]]
            for p in [b for b in blocks if b["pair"] == n and not b["working"]]
        ]
        with open(args.out, "w") as fh:
            json.dump(
                {
                    "world": world,
                    "backend": dist.get_backend(),
                    "ms_per_step": 1e3 * elapsed / steps if steps > 0 else math.nan,
                    "steps": step,
                    "window_start_s": starts,
                    "window_stop_s": stops,
                    "ab_overhead_pct": 100 * (sum(on) / len(on) / (sum(off) / len(off)) - 1)
                    if on and off
                    else None,
                    "ab_median_pair_pct": 100 * statistics.median(pairs) if pairs else None,
                    "ab_pairs": len(pairs),
                },
                fh,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
