"""The suite's job launched: its ranks as spawned processes, waited for (``launch``) or watched
with a deadline and stopped (``RunningJob``: a job that may hang)."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from typing import Any

from benchmarks.procs import free_port

from .catalogue import Fault, JobSpec
from .workload import run_rank


def _entry(rank: int, spec_dict: dict[str, Any], results: Any) -> None:
    fault = spec_dict["fault"]
    spec = JobSpec(**{**spec_dict, "fault": Fault(**{**fault, "ranks": tuple(fault["ranks"])})})
    results.put(run_rank(rank, spec))


def launch(spec: JobSpec) -> list[dict[str, Any]]:
    """Run the job's ranks as spawned processes; returns each rank's stats, by rank."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_entry, args=(asdict(spec), results), nprocs=spec.world_size, start_method="spawn")
    out = [results.get() for _ in range(spec.world_size)]
    return sorted(out, key=lambda r: r["rank"])


class RunningJob:
    """A job started without waiting for it: ``wait`` for its end with a deadline, or ``stop`` it.

    For jobs that may hang: ``launch`` would wait forever.
    """

    def __init__(self, spec: JobSpec) -> None:
        import torch.multiprocessing as mp

        self.spec = spec
        self._results = mp.get_context("spawn").SimpleQueue()
        self._ctx = mp.start_processes(
            _entry,
            args=(asdict(spec), self._results),
            nprocs=spec.world_size,
            start_method="spawn",
            join=False,
        )

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self._ctx.processes]

    def wait(self, timeout_s: float) -> list[dict[str, Any]] | None:
        """Each rank's stats once all ranks ended, or None if they still run after ``timeout_s``.

        Raises torch's ProcessRaisedException / ProcessExitedException if a rank failed.
        """
        deadline = time.monotonic() + timeout_s
        while not self._ctx.join(timeout=0.5):
            if time.monotonic() >= deadline:
                return None
        out = [self._results.get() for _ in range(self.spec.world_size)]
        return sorted(out, key=lambda r: r["rank"])

    def stop(self, grace_s: float = 5.0) -> None:
        """Terminate every rank still running (SIGTERM, then SIGKILL after ``grace_s``)."""
        procs = [p for p in self._ctx.processes if p.is_alive()]
        for p in procs:
            p.terminate()
        deadline = time.monotonic() + grace_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5.0)


if __name__ == "__main__":  # quick manual run: python -m benchmarks.faults.launch [fault] [seconds]
    kind = sys.argv[1] if len(sys.argv) > 1 else "none"
    secs = float(sys.argv[2]) if len(sys.argv) > 2 else 10
    stats = launch(JobSpec(job="manual", port=free_port(), seconds=secs, fault=Fault(kind=kind), hook=None))
    print(stats)
