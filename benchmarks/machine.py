"""How fast the machine itself ran while a scenario's job ran: the harness's own reference.

A healthy control expects no finding only on a machine whose speed held steady. On a shared CI
runner it may not: other tenants (the hypervisor's steal), other processes, a CPU clocked down.
The job then really does slow down as a whole, and a ``job_wide`` finding is right. To tell that
apart from a false alarm without asking rankscope, ``MachineWatch`` samples, while the job runs:

- the *capacity* left to the job: the machine's cores less the hypervisor's steal and the CPU
  that processes outside the harness's process tree (the job is its children) used;
- the time a fixed piece of reference work takes (a CPU clocked down, steal in short bursts).

And ``work``, from the job's step rows: the CPU time its steps took, as the hook read it from the
kernel (no diagnosis in it); a healthy job does the same work every step.

``summary`` compares the last third of the job's steps with the first (start-up, with its
imports, is no baseline); ``slowed`` judges each ratio against its own noise.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pandas as pd

WORK = 60_000
"""The reference work: ``sum(range(WORK))``, about 1 ms on an idle core of these machines."""

SLOWED = 1.15
"""The machine counts as slowed down when the reference work ran this much slower in the last
third of the job's steps than in the first..."""

LOST = 1.10
"""...or when the cores left to the job fell by this factor: processes outside the job and steal
took a tenth of a machine the job fills. Apart from the reference work's, as the two measures'
noise differs: the cores left are counted (jiffies), the reference work is timed. On 30 kept
runs of the suite's jobs on 2 cores, the cores left moved 0.96-1.06x on the 26 without load from
outside, the reference work's time 0.97-1.24x on all (once 1.68x). A CI run's healthy job lost
1.14x of its cores (1.98 -> 1.74) with its reference work 1.03x: its own time per step grew
1.21x, its step time 1.17x, and rankscope rightly found it slowed down as a whole, by external
load."""


WORK_SLOWED = 1.10
"""...or when the job's own steps took this much more CPU time in the last third than in the
first (``work``, the median rank's). A healthy job does the same work every step: its cores
themselves ran slower (a busy hyperthread sibling, caches and memory bandwidth shared with other
tenants, a lower clock), which the two measures above miss: the reference work stays in one
core's cache, the cores left count time, not speed. On 3 runs each of the two healthy DDP jobs
here it moved 0.82-1.22x. One found a job-wide slowdown: own time per step 1.22x, step time
1.15x, its ranks' CPU time per step 1.22x, with the reference work 1.02x and the cores left 1.06x."""


def slowed(speed: dict[str, float] | None) -> bool:
    """Whether the machine slowed down under the job (``speed``: a ``summary``, or those of its
    measures that are known)."""
    limits = {"reference": SLOWED, "capacity": LOST, "work": WORK_SLOWED}
    return speed is not None and any((speed.get(k) or 0.0) >= v for k, v in limits.items())


def work(steps: pd.DataFrame) -> float | None:
    """The CPU time per step of the job's ranks (step rows: ``rank``, ``step``, ``cpu_us``), the
    last two sixths of each rank's steps against its first sixth, the median over ranks (None: too
    few steps): the spans ``job_wide`` compares in a young job (its first chunk, its last two).
    Thirds hid a change a quarter into the run: a CI run's healthy job, every rank's CPU time per
    step 4.3 ms for its first 7 s and 5.5 ms from then on, read 1.09x by thirds, 1.2x by sixths,
    and ``job_wide`` rightly found its steps slower as a whole (cpu time 1.21x)."""
    ratios = []
    for _, r in steps[steps["cpu_us"] > 0].sort_values("step").groupby("rank"):
        sixth = len(r) // 6
        if sixth >= 10:
            ratios.append(r["cpu_us"].iloc[-2 * sixth :].median() / r["cpu_us"].iloc[:sixth].median())
    return round(float(statistics.median(ratios)), 3) if ratios else None


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_jiffies() -> tuple[int, int]:
    """The machine's (busy, steal) jiffies, all cores, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    return user + nice + system + irq + softirq, steal


def _tree_jiffies(root: int) -> dict[int, int]:
    """CPU jiffies (user + system) of ``root`` and every process under it, by pid."""
    parent: dict[int, int] = {}
    used: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        parent[int(d)], used[int(d)] = int(fields[1]), int(fields[11]) + int(fields[12])
    children: dict[int, list[int]] = defaultdict(list)
    for pid, ppid in parent.items():
        children[ppid].append(pid)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in used:
            out[pid] = used[pid]
        todo.extend(children[pid])
    return out


class MachineWatch(threading.Thread):
    """Samples the machine every ``every_s`` until stopped; ``samples`` are ``(wall-clock time,
    reference work seconds, cores left to the harness's process tree)``."""

    def __init__(self, every_s: float = 0.5) -> None:
        super().__init__(daemon=True, name="machine-watch")
        self.every_s = every_s
        self.samples: list[tuple[float, float, float]] = []
        self._done = threading.Event()

    def run(self) -> None:
        cores = len(os.sched_getaffinity(0))
        root = os.getpid()
        last_t, (last_busy, last_steal), last_tree = time.monotonic(), _cpu_jiffies(), _tree_jiffies(root)
        while not self._done.wait(self.every_s):
            w = time.perf_counter()
            sum(range(WORK))
            took = time.perf_counter() - w
            now, (busy, steal), tree = time.monotonic(), _cpu_jiffies(), _tree_jiffies(root)
            ours = sum(v - last_tree[p] for p, v in tree.items() if p in last_tree)
            outside = max(busy - last_busy - ours, 0) + (steal - last_steal)
            left = cores - outside / _TICK / (now - last_t)
            self.samples.append((round(time.time(), 3), took, round(max(left, 0.05), 3)))
            last_t, last_busy, last_steal, last_tree = now, busy, steal, tree

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.samples))


def summary(
    samples: list[Any], start: float = 0.0, end: float = float("inf"), work: float | None = None
) -> dict[str, float] | None:
    """Over the samples from ``start`` to ``end`` (wall-clock seconds; the job's steps), last third
    against first: ``reference``, the reference work's median time; ``capacity``, the cores left
    to the job (median), first over last; ``work``, as given (the job's ``work``, where known);
    ``slowdown``, the largest. Medians: the job's own bursts (rank 0's evaluation, a
    profiling window) delay single samples."""
    samples = [s for s in samples if start <= s[0] <= end]
    if len(samples) < 6:
        return None
    third = len(samples) // 3
    first, last = samples[:third], samples[-third:]
    reference = statistics.median(s[1] for s in last) / statistics.median(s[1] for s in first)
    capacity = statistics.median(s[2] for s in first) / statistics.median(s[2] for s in last)
    out = {
        "slowdown": round(max(reference, capacity, work or 0.0), 3),
        "reference": round(reference, 3),
        "capacity": round(capacity, 3),
        "cores_first": round(statistics.median(s[2] for s in first), 2),
        "cores_last": round(statistics.median(s[2] for s in last), 2),
    }
    return out if work is None else {**out, "work": work}


def load(
    path: Path, start: float = 0.0, end: float = float("inf"), work: float | None = None
) -> dict[str, float] | None:
    """The ``summary`` of the samples a run kept (None for a run kept before the harness took them)."""
    try:
        samples = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return summary(samples, start, end, work)
