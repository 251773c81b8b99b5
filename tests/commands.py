"""The ``rankscope`` and ``torchrun`` commands as the tests run them."""

from __future__ import annotations

import subprocess
import sys


def rankscope(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``rankscope *args`` in a new process of this interpreter, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "rankscope.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def torchrun(nproc: int) -> list[str]:
    """``torchrun`` of this interpreter for ``nproc`` local processes, on a free port; the script
    and its arguments follow."""
    from benchmarks.procs import free_port

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
    ]
