"""What one node measures: its devices, compute and memory bandwidth, and (with its peers) the
network — an all-reduce's bus bandwidth and the bandwidth of its send to the next node in a ring.

All need torch; the network probes a process group (gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from typing import Any

import torch
import torch.distributed as dist


def devices() -> dict[str, Any]:
    """GPUs present and counted, and their errors (uncorrected ECC, XID) where NVML or nvidia-smi says."""
    if not torch.cuda.is_available():
        return {"device": "cpu", "gpus": 0, "gpu_errors": [], "note": "no GPU: CPU checks only"}
    out: dict[str, Any] = {"device": "cuda", "gpus": torch.cuda.device_count(), "gpu_errors": []}
    try:
        import pynvml

        pynvml.nvmlInit()
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            ecc = pynvml.nvmlDeviceGetTotalEccErrors(
                h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
            )
            if ecc:
                out["gpu_errors"].append(f"GPU {i}: {ecc} uncorrected ECC errors")
    except Exception as exc:  # pynvml missing, or ECC not supported by the board
        out["note"] = f"NVML not read ({type(exc).__name__}: {exc})"
        if shutil.which("nvidia-smi"):
            q = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=index,ecc.errors.uncorrected.volatile.total",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            for line in q.stdout.splitlines():
                idx, _, errs = line.partition(",")
                if errs.strip().isdigit() and int(errs) > 0:
                    out["gpu_errors"].append(f"GPU {idx.strip()}: {errs.strip()} uncorrected ECC errors")
    return out


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _best_rate(fn: Any, work: float, seconds: float) -> float:
    """``work`` per second of ``fn``'s fastest run in about ``seconds`` (after one warm-up), as
    STREAM reports its best trial: a neighbour's burst on a shared machine slows some runs, not the node."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return work / best


def matmul_gflops(size: int = 1024, seconds: float = 0.5) -> float:
    a = torch.randn(size, size, device=_device())
    b = torch.randn(size, size, device=_device())
    return _best_rate(lambda: torch.mm(a, b), 2 * size**3 / 1e9, seconds)


def memory_gbps(mbytes: int = 256, seconds: float = 0.5) -> float:
    """A copy's bandwidth: every byte read once and written once."""
    src = torch.empty(mbytes << 20, dtype=torch.uint8, device=_device())
    dst = torch.empty_like(src)
    return _best_rate(lambda: dst.copy_(src), 2 * src.numel() / 1e9, seconds)


def allreduce_busbw_gbps(mbytes: int = 16, rounds: int = 5) -> float:
    """nccl-tests' bus bandwidth: size / time x 2(n-1)/n, the median of ``rounds``."""
    x = torch.ones(mbytes << 18, device=_device())  # float32: 4 bytes each
    n = dist.get_world_size()
    times = []
    dist.all_reduce(x)  # warm-up: connections
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    took = sorted(times)[len(times) // 2]
    return x.numel() * 4 / took * 2 * (n - 1) / n / 1e9


def ring_send_gbps(mbytes: int = 16, rounds: int = 3, serial: bool = False) -> float:
    """The bandwidth of this rank's send to the next rank while every rank sends to its next at
    once (each link carries one transfer), the best of ``rounds``; ``serial``: one link at a time
    (ranks that share a machine would otherwise compete for its cores)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.ones(mbytes << 18, device=_device())
    into = torch.empty_like(out)
    best = 0.0
    for i in range(rounds + 1):  # the first round opens the connections
        for turn in range(n) if serial else (None,):
            dist.barrier()
            t0 = time.perf_counter()
            send = dist.isend(out, (rank + 1) % n) if turn in (None, rank) else None
            recv = dist.irecv(into, (rank - 1) % n) if turn in (None, (rank - 1) % n) else None
            if send is not None:
                send.wait()
                if i:
                    best = max(best, out.numel() * 4 / (time.perf_counter() - t0) / 1e9)
            if recv is not None:
                recv.wait()
    return best
