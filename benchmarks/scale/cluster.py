"""A synthetic cluster: one job's records for 1,000 to 100,000 ranks, with one injected fault.

    python -m benchmarks.scale.cluster [--ranks 1000,10000,100000] [--faults all] [--seeds 1] [--json PATH]

For each size and fault the script generates the frames the store returns (``diagnosis.JobData``),
runs ``diagnosis.diagnose`` on them, scores the top finding against the ground truth and times the
diagnosis. It prints a markdown table and writes JSON (``latency_s`` per size, ``top1_accuracy``,
``healthy_false_findings``).

The job: synchronous data parallelism. Every step each rank loads a batch and computes, then all
ranks all-reduce their gradients; the collective ends for everybody when the last rank arrived and
the ring moved the bytes, which is as fast as its slowest link. Ranks sit 8 to a host, hosts have
4 NICs (2 ranks each, as 4 EFA NICs serve 8 GPUs on a p4d) and 32 hosts hang off one leaf switch.

Healthy variation: each rank's speed differs a little (sigma 1.5%) and drifts slowly (sigma 1% over
the run), the whole job drifts (2%), every step has machine-wide noise (3%) and per-rank jitter
(3%), 0.1% of rank-steps spike 1.1-1.5x, each function in a window has its own jitter (3%), and each
rank's network send time per byte its own (3%). Scale: 60 steps of ~0.4 s (24 s: a job-wide
slowdown is only judged against a baseline of 20 s or more) of step rows per rank and two
profiling windows of 5 steps (one window is never a finding) with 33 patterns per rank (production windows hold a few hundred
functions; the per-rank work of the diagnosis grows with that number).

What a fault changes — only signals a real cluster shows:

* ``compute``: one rank's GPU runs its kernels slower (throttling): its own time per step grows.
* ``host``: the same on all 8 ranks of one host (power capping, a bad host).
* ``dataloader``: one rank waits longer for its batches.
* ``nic`` / ``switch``: the network send time per byte of the ranks behind one NIC / one switch
  grows (a link trained down, a congested uplink). The ring waits for its slowest link, so every
  rank's collective takes longer by the same amount and no rank's own time changes: only the
  per-rank transfer measurement — bytes over the time spent sending them, as NCCL's profiler
  plugin reports per proxy step, recorded here as the ``net_send@world`` collective pattern —
  points at the culprits.
* ``contention``: a noisy neighbour on one host takes CPU from its 8 ranks. Their compute keeps
  its pace (a thread waking from a sleep preempts the intruder), but the threads that drive the
  transfers queue for a CPU: every rank's collective takes longer and no rank's own time grows.
  Only the ranks' CPU wait — the run-queue time of their threads, the hook's ``cpu_wait@sched``
  pattern (healthy: ~1 ms per step, sigma 30%) — points at the host.
* ``job_wide``: every rank's compute slows from the onset step on (a software or storage change).
* ``hang``: one rank stops before collective #K; the others enter it and wait. Heartbeats only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from rankscope.diagnosis import Diagnosis, JobData, diagnose
from rankscope.diagnosis.data import HEARTBEAT_FIELDS, STEP_FIELDS

FAULTS = ("none", "compute", "host", "contention", "nic", "switch", "dataloader", "job_wide", "hang")
CAUSE = {
    "compute": "compute",
    "host": "compute",
    "nic": "communication",
    "switch": "communication",
    "dataloader": "dataloader",
    "contention": "host_contention",
    "job_wide": "job_wide",
    "hang": "hang",
}
SCOPE = {"host": "host", "contention": "host", "nic": "nic", "switch": "switch", "job_wide": "job"}
MAGNITUDE = {
    "compute": 1.3,
    "host": 1.3,
    "contention": 1.5,
    "nic": 2.5,
    "switch": 1.8,
    "dataloader": 100_000.0,
    "job_wide": 1.5,
}
"""Default fault sizes: slowdown factors (of the collectives' transfers for ``contention``); for
``dataloader`` the extra data wait in us per step."""

COMPUTE_US = 320_000.0
DATA_US = 8_000.0
TRANSFER_US = 60_000.0
CPU_WAIT_US = 4_000.0
"""Healthy run-queue wait of a rank's threads per step."""
QUEUED_THREADS = 3
"""Threads of a contended rank whose queueing delays its transfers (and each waits that long)."""
GRAD_BYTES = 2 * 10**9
"""Gradient bytes all-reduced per step (1B parameters in bf16)."""
BUCKETS = 20
"""All-reduce calls per step (DDP buckets)."""
T0_US = 1_700_000_000_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    ranks: int = 1000
    fault: str = "none"
    magnitude: float | None = None
    """The fault's size; ``None`` takes ``MAGNITUDE[fault]``."""
    seed: int = 0
    steps: int = 60
    onset_step: int = 20
    windows: tuple[tuple[int, int], ...] = ((35, 40), (45, 50))
    """The profiling windows' steps [lo, hi): after the onset, as windows triggered by it would be."""
    ranks_per_host: int = 8
    nics_per_host: int = 4
    hosts_per_switch: int = 32

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {self.fault!r}")
        if self.ranks < 2 * self.ranks_per_host:
            raise ValueError(f"ranks must be at least 2 hosts ({2 * self.ranks_per_host}), got {self.ranks}")
        for lo, hi in self.windows:
            if not 0 <= lo < hi <= self.steps:
                raise ValueError(f"window {(lo, hi)} must lie inside steps [0, {self.steps})")
        if not 0 < self.onset_step <= min(lo for lo, _ in self.windows):
            raise ValueError(f"onset_step must be in (0, the first window's start], got {self.onset_step}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Truth:
    fault: str
    cause: str | None
    """The cause a correct top finding names (``None``: healthy, no finding is correct)."""
    ranks: list[int]
    scope: str
    where: str
    """The host, NIC or switch at fault ("" for a rank or the whole job)."""
    onset_step: int
    onset_time_us: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    spec: ClusterSpec
    data: JobData
    truth: Truth
    generate_s: float


@dataclass(frozen=True, slots=True)
class _Layout:
    host: np.ndarray
    nic: np.ndarray
    switch: np.ndarray
    host_names: list[str] = field(default_factory=list)


def _layout(spec: ClusterSpec) -> _Layout:
    r = np.arange(spec.ranks)
    host = r // spec.ranks_per_host
    nic = host * spec.nics_per_host + (r % spec.ranks_per_host) * spec.nics_per_host // spec.ranks_per_host
    return _Layout(host=host, nic=nic, switch=host // spec.hosts_per_switch)


def _culprits(spec: ClusterSpec, lay: _Layout, rng: np.random.Generator) -> tuple[np.ndarray, str, str]:
    """(culprit ranks, scope, where) for the spec's fault, the place drawn at random."""
    n, f = spec.ranks, spec.fault
    if f in ("compute", "dataloader", "hang"):
        return np.array([int(rng.integers(n))]), "rank", ""
    if f in ("host", "contention"):
        h = int(rng.integers(lay.host[-1] + 1))
        return np.flatnonzero(lay.host == h), "host", f"node{h:05d}"
    if f == "nic":
        k = int(rng.integers(lay.nic[-1] + 1))
        h, i = divmod(k, spec.nics_per_host)
        return np.flatnonzero(lay.nic == k), "nic", f"node{h:05d}-nic{i}"
    if f == "switch":
        # A whole switch: the last one may be partly filled, so draw among the full ones.
        full = max(1, (lay.host[-1] + 1) // spec.hosts_per_switch)
        k = int(rng.integers(full))
        return np.flatnonzero(lay.switch == k), "switch", f"leaf{k:03d}"
    if f == "job_wide":
        return np.arange(n), "job", ""
    return np.array([], dtype=int), "", ""


def _ranks_frame(spec: ClusterSpec, lay: _Layout) -> pd.DataFrame:
    hosts = np.array([f"node{h:05d}" for h in range(lay.host[-1] + 1)], dtype=object)
    nics = np.array([f"nic{i}" for i in range(spec.nics_per_host)], dtype=object)
    switches = np.array([f"leaf{s:03d}" for s in range(lay.switch[-1] + 1)], dtype=object)
    host = hosts[lay.host]
    return pd.DataFrame(
        {
            "rank": np.arange(spec.ranks),
            "host": host,
            "nic": host + "-" + nics[lay.nic % spec.nics_per_host],
            "switch": switches[lay.switch],
        }
    )


def _steps(
    spec: ClusterSpec, culprits: np.ndarray, rng: np.random.Generator
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """(per rank x step arrays, per-rank send time factor, per-step end time) of the always-on rows."""
    n, s, f = spec.ranks, spec.steps, spec.fault
    mag = spec.magnitude if spec.magnitude is not None else MAGNITUDE.get(f, 1.0)
    t = np.arange(s) / s
    speed = rng.lognormal(0.0, 0.015, n)[:, None] * (1 + rng.normal(0.0, 0.01, n)[:, None] * t)
    machine = (1 + 0.02 * np.sin(2 * np.pi * (t + rng.random()))) * rng.lognormal(0.0, 0.03, s)
    jitter = rng.lognormal(0.0, 0.03, (n, s))
    spike = rng.random((n, s)) < 0.001
    jitter[spike] *= rng.uniform(1.1, 1.5, int(spike.sum()))
    compute = COMPUTE_US * speed * machine * jitter
    data = DATA_US * rng.lognormal(0.0, 0.2, (n, s))
    after = slice(spec.onset_step, None)
    if f in ("compute", "host"):
        compute[culprits, after] *= mag
    elif f == "job_wide":
        compute[:, after] *= mag
    elif f == "dataloader":
        data[culprits, after] += mag
    # Each rank's network send time per byte; the ring moves as fast as its slowest link.
    send = rng.lognormal(0.0, 0.03, n)
    link = np.ones(s)
    cpu_wait = CPU_WAIT_US * rng.lognormal(0.0, 0.3, (n, s))
    if f in ("nic", "switch"):
        send[culprits] *= mag
        link[after] = mag
    elif f == "contention":
        link[after] = mag
        cpu_wait[culprits, after] += QUEUED_THREADS * (mag - 1) * TRANSFER_US
    own = compute + data
    end = own.max(axis=0) + TRANSFER_US * link * rng.lognormal(0.0, 0.02, s)
    comm = end[None, :] - own
    arrays = {
        "dur_us": np.broadcast_to(end + 300.0, (n, s)),
        "data_us": data,
        "comm_us": comm,
        "cpu_us": compute * 0.97 * rng.lognormal(0.0, 0.01, (n, s)),
        "nivcsw": rng.poisson(3.0, (n, s)),
        "wait_us": np.zeros((n, s)),  # a training thread on its own cores never queues
        "gc_us": np.zeros((n, s)),  # nor collects more than its peers
        "compute": compute,
        "cpu_wait": cpu_wait,
    }
    return arrays, send, end + 300.0


def _steps_frame(spec: ClusterSpec, arrays: dict[str, np.ndarray]) -> pd.DataFrame:
    n, s = spec.ranks, spec.steps
    cols: dict[str, np.ndarray] = {"rank": np.repeat(np.arange(n), s), "step": np.tile(np.arange(s), n)}
    for c in STEP_FIELDS[2:]:
        cols[c] = np.ascontiguousarray(arrays[c]).ravel()
    return pd.DataFrame(cols)[STEP_FIELDS]


_KERNELS = [f"sm90_xmma_gemm_bf16bf16_bf16f32_{i}" for i in range(12)] + [
    "flash_fwd_kernel",
    "flash_bwd_dq_dk_dv_loop_kernel",
    "vectorized_elementwise_kernel<4, GeluFunctor>",
    "vectorized_layer_norm_kernel",
    "layer_norm_grad_input_kernel",
    "multi_tensor_apply_kernel<AdamFunctor>",
    "reduce_kernel<512, 1, ReduceOp<float, NormTwoOps>>",
    "softmax_warp_forward",
]
_OPS = [
    "aten::mm",
    "aten::addmm",
    "aten::gelu",
    "aten::native_layer_norm",
    "aten::_foreach_add_",
    "aten::copy_",
]
_PYTHON = [
    ("train.py(88): forward", "train.py(140): train_step"),
    ("train.py(95): backward", "train.py(140): train_step"),
]
_LOADER = "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__"


def _tiled_strings(values: list[str], n: int) -> pd.Series:
    """``values`` repeated ``n`` times as a string column, built in Arrow (not 3M Python strings)."""
    codes = pa.array(np.tile(np.arange(len(values), dtype=np.int32), n))
    arr = pa.DictionaryArray.from_arrays(codes, pa.array(values)).cast(pa.large_string())
    return pd.Series(pd.array(arr, dtype=pd.StringDtype("pyarrow", na_value=np.nan)))


def _functions(
    spec: ClusterSpec, arrays: dict[str, np.ndarray], send: np.ndarray, rng: np.random.Generator
) -> pd.DataFrame:
    """The profiling windows' patterns, window by window."""
    return pd.concat(
        [_window(spec, i, arrays, send, rng) for i in range(len(spec.windows))], ignore_index=True
    )


def _window(
    spec: ClusterSpec, number: int, arrays: dict[str, np.ndarray], send: np.ndarray, rng: np.random.Generator
) -> pd.DataFrame:
    """One profiling window's patterns: 33 per rank (31 functions, the CPU wait, the send rate), by rank."""
    n = spec.ranks
    lo, hi = spec.windows[number]
    w = hi - lo
    compute = arrays["compute"][:, lo:hi].sum(axis=1)
    data = arrays["data_us"][:, lo:hi].sum(axis=1)
    comm = arrays["comm_us"][:, lo:hi].sum(axis=1)
    cpu_wait = arrays["cpu_wait"][:, lo:hi].sum(axis=1)
    k = len(_KERNELS)
    # The kernels share the GPU time; CPU-side operators and the Python frames that launch them.
    share = rng.dirichlet(np.full(k, 2.0))
    names = [*_KERNELS, *_OPS, *(p for p, _ in _PYTHON), _LOADER, "Memcpy HtoD (Pinned -> Device)"]
    names += ["all_reduce@world", "net_send@world", "cpu_wait@sched"]
    kinds = ["kernel"] * k + ["op"] * len(_OPS) + ["python"] * len(_PYTHON) + ["dataloader", "memcpy"]
    kinds += ["collective", "collective", "sched"]
    stacks = [""] * (k + len(_OPS)) + [c for _, c in _PYTHON] + ["", "", "", "", ""]
    threads = 24 / w  # the pattern's count is the process's threads, not executions
    per_step = np.array([4.0] * k + [40.0] * len(_OPS) + [1.0, 1.0, 1.0, 2.0, BUCKETS, BUCKETS * 8, threads])
    nf = len(names)
    total = np.empty((n, nf))
    total[:, :k] = compute[:, None] * share[None, :]
    total[:, k : k + len(_OPS)] = 0.02 * COMPUTE_US * w / len(_OPS)
    total[:, k + len(_OPS)] = 0.4 * compute
    total[:, k + len(_OPS) + 1] = 0.55 * compute
    total[:, -5] = data
    total[:, -4] = 500.0 * w
    total[:, -3] = comm
    sent = 2 * GRAD_BYTES * w
    total[:, -2] = TRANSFER_US * w * send
    total *= rng.lognormal(0.0, 0.03, (n, nf))
    total[:, -1] = cpu_wait  # its own noise already
    count = np.broadcast_to(per_step * w, (n, nf))
    nbytes = np.zeros(nf, dtype=np.int64)
    nbytes[-3:-1] = [GRAD_BYTES * w, sent]
    mean = total / count
    return pd.DataFrame(
        {
            "rank": np.repeat(np.arange(n), nf),
            "window": number,
            "step_lo": lo,
            "step_hi": hi,
            "kind": _tiled_strings(kinds, n),
            "name": _tiled_strings(names, n),
            "stack": _tiled_strings(stacks, n),
            "count": count.ravel().astype(np.int64),
            "total_us": total.ravel(),
            "mean_us": mean.ravel(),
            "p50_us": (mean * rng.lognormal(-0.02, 0.01, (n, nf))).ravel(),
            "max_us": 2 * mean.ravel(),  # the slowest call; only read where a window left functions out
            "nbytes": np.tile(nbytes, n),
        }
    )


def _heartbeats(
    spec: ClusterSpec, culprits: np.ndarray, end_us: float, rng: np.random.Generator
) -> pd.DataFrame:
    """The latest heartbeat per rank: every 5 s; a hung job has made no progress for 40 s."""
    n = spec.ranks
    seq = spec.steps * BUCKETS
    hung = spec.fault == "hang"
    in_coll = np.ones(n, dtype=bool) if hung else rng.random(n) < 0.3
    last = np.full(n, seq)
    stack = np.full(n, "", dtype=object)
    if hung:
        in_coll[culprits] = False
        last[culprits] = seq - 1
        stack[culprits] = (
            '  File "train.py", line 140, in train_step\n    loss = model(batch)\n'
            '  File "model.py", line 212, in forward\n    self.router.sync_expert_counts()\n'
        )
    age = (40.0 if hung else 0.0) + rng.uniform(0.0, 2.0, n)
    return pd.DataFrame(
        {
            "rank": np.arange(n),
            "time_us": (end_us + (40e6 if hung else 0.0) - rng.uniform(0.0, 5e6, n)).astype(np.int64),
            "step": spec.steps,
            "progress_age_s": age,
            "coll_group": np.where(in_coll, "world", ""),
            "coll_op": np.where(in_coll, "all_reduce", ""),
            "coll_seq": np.where(in_coll, seq, -1),
            "coll_peer": -1,
            "last_seq": [{"world": int(x)} for x in last],
            "stack": stack,
            "window_cost_us": np.zeros(n, dtype=np.int64),
            "gpu_xids": [{} for _ in range(n)],
        }
    )[HEARTBEAT_FIELDS]


def generate(spec: ClusterSpec) -> Case:
    """The job's frames and the ground truth of its fault; vectorized (100k ranks in seconds)."""
    t0 = time.perf_counter()
    rng = np.random.default_rng([spec.seed, FAULTS.index(spec.fault)])
    lay = _layout(spec)
    culprits, scope, where = _culprits(spec, lay, rng)
    arrays, send, step_end = _steps(spec, culprits, rng)
    starts = T0_US + np.concatenate([[0.0], np.cumsum(step_end)])
    data = JobData(
        job=f"cluster-{spec.ranks}-{spec.fault}-{spec.seed}",
        ranks=_ranks_frame(spec, lay),
        steps=_steps_frame(spec, arrays),
        functions=_functions(spec, arrays, send, rng),
        heartbeats=_heartbeats(spec, culprits, float(starts[-1]), rng),
    )
    onset = spec.steps if spec.fault == "hang" else spec.onset_step
    truth = Truth(
        fault=spec.fault,
        cause=CAUSE.get(spec.fault),
        ranks=[int(r) for r in culprits],
        scope=scope,
        where=where,
        onset_step=onset,
        onset_time_us=int(starts[onset]),
    )
    return Case(spec=spec, data=data, truth=truth, generate_s=time.perf_counter() - t0)


def score(d: Diagnosis, truth: Truth) -> dict[str, Any]:
    """Is the top finding right: cause, the culprit ranks and, for a host/NIC/switch, its scope?"""
    top = d.findings[0] if d.findings else None
    if truth.cause is None:
        correct = top is None
    else:
        correct = (
            top is not None
            and top.cause == truth.cause
            and sorted(top.ranks) == truth.ranks
            and (truth.scope not in SCOPE.values() or top.scope == truth.scope)
        )
    return {
        "correct": bool(correct),
        "findings": len(d.findings),
        "top": None
        if top is None
        else {"cause": top.cause, "scope": top.scope, "ranks": len(top.ranks), "hosts": top.hosts[:3]},
        "confidence": top.confidence if top else None,
    }


def run_case(spec: ClusterSpec) -> dict[str, Any]:
    case = generate(spec)
    t0 = time.perf_counter()
    d = diagnose(case.data)
    latency = time.perf_counter() - t0
    return {
        "ranks": spec.ranks,
        "fault": spec.fault,
        "seed": spec.seed,
        "truth": {"cause": case.truth.cause, "scope": case.truth.scope, "where": case.truth.where},
        "generate_s": round(case.generate_s, 3),
        "latency_s": round(latency, 3),
        **score(d, case.truth),
    }


def _table(rows: list[dict[str, Any]]) -> str:
    out = ["| ranks | fault | correct | confidence | findings | top finding | diagnose s | generate s |"]
    out.append("|---:|---|:-:|---:|---:|---|---:|---:|")
    for r in rows:
        top = r["top"]
        what = "—" if top is None else f"{top['cause']}/{top['scope']} {top['ranks']} rank(s) {top['hosts']}"
        conf = "—" if r["confidence"] is None else f"{r['confidence']:.2f}"
        out.append(
            f"| {r['ranks']} | {r['fault']} | {'yes' if r['correct'] else 'NO'} | {conf} | {r['findings']} "
            f"| {what} | {r['latency_s']:.2f} | {r['generate_s']:.2f} |"
        )
    return "\n".join(out)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    faulty = [r for r in rows if r["fault"] != "none"]
    healthy = [r for r in rows if r["fault"] == "none"]
    sizes = sorted({r["ranks"] for r in rows})
    by_fault = {f: [r for r in faulty if r["fault"] == f] for f in FAULTS if f != "none"}
    return {
        "latency_s": {
            str(n): statistics.median(r["latency_s"] for r in rows if r["ranks"] == n) for n in sizes
        },
        "latency_max_s": {str(n): max(r["latency_s"] for r in rows if r["ranks"] == n) for n in sizes},
        "top1_accuracy": round(sum(r["correct"] for r in faulty) / len(faulty), 4) if faulty else None,
        "accuracy_by_fault": {
            f: round(sum(r["correct"] for r in rs) / len(rs), 4) for f, rs in by_fault.items() if rs
        },
        "healthy_false_findings": sum(r["findings"] for r in healthy),
        "healthy_runs": len(healthy),
        "cases": rows,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1000,10000,100000", help="comma-separated job sizes")
    p.add_argument("--faults", default="all", help=f"comma-separated, from {', '.join(FAULTS)}")
    p.add_argument("--seeds", type=int, default=1, help="cases per size and fault (different placements)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    faults = FAULTS if a.faults == "all" else tuple(a.faults.split(","))
    rows = []
    for n in (int(x) for x in a.ranks.split(",")):
        for fault in faults:
            for seed in range(a.seeds):
                row = run_case(ClusterSpec(ranks=n, fault=fault, seed=seed))
                rows.append(row)
                print(
                    f"  {n} ranks, {fault}, seed {seed}: {'ok' if row['correct'] else 'MISS'} "
                    f"in {row['latency_s']:.2f} s",
                    file=sys.stderr,
                )
    result = summarize(rows)
    print(_table(rows))
    print()
    print(
        f"top-1 accuracy {result['top1_accuracy']}, healthy false findings "
        f"{result['healthy_false_findings']} over {result['healthy_runs']} run(s), "
        f"diagnosis latency (median s) {result['latency_s']}"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
