"""Turn one profiling window's raw events into per-function execution patterns.

A raw window holds thousands of events per step; a summary holds one row per function identity
(kind, name, and a stack: the calling functions of a Python function, the operator that launched a
device's kernel or copy) with its count, duration distribution and start intervals. This is the
EROICA idea: patterns, not traces, are what ranks can be compared on.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
import os
import re
import sys
import sysconfig
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from rankscope.wire.records import CUT_KIND, FunctionPattern

from . import events
from .collectives import CollectiveCall

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_COLLECTIVE_PREFIXES = (
    "gloo:",
    "nccl:",
    "c10d::",
    "_c10d_functional",  # DTensor's: "_c10d_functional::all_reduce", "_c10d_functional::wait_tensor"
    "record_param_comms",
    "ncclDevKernel",
    "ncclKernel",
)
_STACK_DEPTH = 3


_OWN = "rankscope/profiler_hook/"
"""The hook's own modules, as the profiler names them (relative to their ``sys.path`` entry):
never the job's code."""
_HOOK_DIR = os.path.dirname(os.path.realpath(__file__)) + os.sep
"""The hook's directory, links resolved: a checkout's ``rankscope/profiler_hook`` is a link to its
``profiler_hook/``, and a script in ``rankscope/`` has that directory first on ``sys.path``."""


def _hook_file(path: str) -> bool:
    """Whether ``path`` is one of the hook's files, however it was reached."""
    return os.path.realpath(path).startswith(_HOOK_DIR)


@functools.cache
def library_dirs() -> tuple[str, ...]:
    """The standard library's and the installed packages' directories."""
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)}
    return tuple(sorted(dirs))


@functools.cache
def _library_module(top: str) -> bool:
    """Whether top-level module ``top`` is the standard library's or an installed package's."""
    if top in sys.stdlib_module_names:
        return True
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: finds, imports nothing
    except (ImportError, ValueError):
        return False
    where = (spec.origin if spec else None) or next(
        iter((spec and spec.submodule_search_locations) or []), ""
    )
    return bool(where) and ("-packages/" in where or where.startswith(library_dirs()) or _hook_file(where))


def _torch_modules() -> frozenset[str]:
    """Names of torch's own module classes (Linear, DistributedDataParallel, FSDPModule...)."""
    global _TORCH_MODULES
    nn = sys.modules.get("torch.nn")
    if _TORCH_MODULES is None and nn is not None:
        seen, todo = set(), [nn.Module]
        while todo:
            for c in todo.pop().__subclasses__():
                if c.__name__ not in seen and c.__module__.startswith("torch."):
                    seen.add(c.__name__)
                todo.append(c)
        _TORCH_MODULES = frozenset(seen)
    return _TORCH_MODULES or frozenset()


_TORCH_MODULES: frozenset[str] | None = None


@functools.lru_cache(maxsize=8192)
def library_frame(name: str) -> bool:
    """Whether a profiled Python function (``"torch/nn/modules/module.py(1751): _call_impl"``,
    ``"<built-in method ...>"``, ``"nn.Module: Linear_1"``) is the interpreter's, the standard
    library's or an installed package's rather than the job's own code. The profiler writes paths
    relative to their ``sys.path`` entry, so the first component names the top-level module; a
    module event is the job's own when its class is not one of ``torch.nn``'s."""
    if name.startswith("<"):
        return True
    if name.startswith("nn.Module: "):  # the profiler's module events: "nn.Module: Linear_1"
        return name[11:].rsplit("_", 1)[0] in _torch_modules()
    path = name.split("(", 1)[0]
    if path.startswith("/"):  # a file outside every sys.path entry (an editable install's)
        return "-packages/" in path or path.startswith(library_dirs()) or _hook_file(path)
    return path.startswith(_OWN) or _library_module(path.split("/", 1)[0].removesuffix(".py"))


_MICROBATCH = re.compile(r"^(Forward|Backward) \d+$|(\d+[A-Z_]+?)\d+(?=[;)]|$)")
"""A microbatch's index in ``torch.distributed.pipelining``'s annotations of a schedule's work:
``Forward 3`` and ``Backward 3`` (GPipe), ``PP:0F3``, ``PP:(0F3;1B2)OVERLAP_F_B`` (the runtime
schedules: stage, action, microbatch). Every microbatch runs the stage's same function."""


def _function(match: re.Match[str]) -> str:
    return match[1] or match[2]


@functools.lru_cache(maxsize=16384)
def _identity(name: str, activity: str, is_python: bool) -> tuple[str, str] | None:
    """A raw event's function (its kind and name), or None for no function of the workload: the
    name without an object's address, and a pipeline schedule's annotation without its microbatch."""
    kind = _kind(name, activity, is_python)
    if kind is None:
        return None
    name = _ADDRESS.sub("", name)
    if activity == "user_annotation" and name.startswith(("Forward ", "Backward ", "PP:")):
        name = _MICROBATCH.sub(_function, name)
    return kind, name


def _kind(name: str, activity: str, is_python: bool) -> str | None:
    if is_python:
        return "pylib" if library_frame(name) else "python"
    if activity == "kernel":
        return "collective" if name.startswith(_COLLECTIVE_PREFIXES) else "kernel"
    if activity in ("gpu_memcpy", "gpu_memset"):
        return "memcpy"
    if activity == "user_annotation":
        if name.startswith("ProfilerStep"):
            return None
        if name.startswith(_COLLECTIVE_PREFIXES):
            return "collective"  # process groups annotate their collectives: "gloo:all_reduce"
        # A range the code marked (``record_function``: a schedule's "Forward", FSDP's
        # "FSDP::post_backward_reduce", a user's own): it encloses operators, it is none.
        return "dataloader" if "DataLoader" in name else "annotation"
    if activity == "cpu_op":
        return "collective" if name.startswith(_COLLECTIVE_PREFIXES) else "op"
    return None  # runtime/driver calls, profiler overhead: not functions of the workload


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on a sorted list."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _mean_cv(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if mean <= 0:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / n
    return mean, math.sqrt(var) / mean


def pattern(
    kind: str, name: str, stack: str, starts: list[int], durs: list[int], nbytes: int = 0
) -> FunctionPattern:
    """The execution pattern of one function from its start times and durations (nanoseconds).

    Plain Python rather than numpy: most groups hold a handful of values, where numpy's per-call
    cost dominates (measured: 4x slower summaries with np.percentile per group).
    """
    d = sorted(x / 1e3 for x in durs)
    mean, cv = _mean_cv(d)
    s = sorted(starts)
    gaps = [(b - a) / 1e3 for a, b in itertools.pairwise(s)]
    interval, interval_cv = _mean_cv(gaps) if gaps else (0.0, 0.0)
    return FunctionPattern(
        kind=kind,
        name=name,
        stack=stack,
        count=len(d),
        total_us=round(sum(d), 1),
        mean_us=round(mean, 2),
        p50_us=round(_quantile(d, 0.5), 2),
        p90_us=round(_quantile(d, 0.9), 2),
        max_us=round(d[-1], 2),
        cv=round(cv, 4),
        interval_us=round(interval, 1),
        interval_cv=round(interval_cv, 4),
        nbytes=int(nbytes),
    )


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, -1
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


_EDGE_NS = 100_000
"""The profiler records the frames open at its start as starting then, and those open at its stop
as ending then; a frame within this of the window's edges was open there."""


def summarize(
    results: Any,
    calls: Iterable[CollectiveCall],
    window_ns: int,
    max_functions: int,
    epoch_offset_ns: int = 0,
) -> tuple[list[FunctionPattern], dict[str, float], int]:
    """Summarize a window's profiler results (``prof.profiler.kineto_results``, read by
    :func:`events.read`) and tracked collectives.

    Collective calls carry ``time.perf_counter_ns`` times; ``epoch_offset_ns`` moves them onto the
    profiler's clock (nanoseconds since the epoch).

    Returns the function patterns (the ``max_functions`` largest by total time), the main thread's
    busy fractions (``compute``, ``comm``, ``data``, ``idle``) and the number of events read.
    """
    groups: dict[tuple[str, str, str], tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    python: dict[int, tuple[str, int]] = {}
    kind_of_python: dict[int, str] = {}
    pending_python: list[tuple[int, int, int, int]] = []
    busy: dict[str, list[tuple[int, int]]] = {"compute": [], "comm": [], "data": []}
    threads: Counter[int] = Counter()
    cpu_events: list[tuple[str, int, int, int, int, str]] = []
    device: list[tuple[str, str, int, int, int, int]] = []
    on_device = events.DEVICE
    n = 0
    for name, activity, start, dur, tid, pid, parent, corr, linked, nbytes in events.read(results):
        n += 1
        is_python = pid >= 0
        known = _identity(name, activity, is_python)
        if known is None:
            continue
        kind, name = known
        if is_python:
            python[pid] = (name, parent)
            kind_of_python[pid] = kind
            pending_python.append((pid, tid, start, dur))
            continue
        if activity in on_device:
            # Grouped below, by the operator that launched it; a device's thread id is its stream.
            device.append((kind, name, start, dur, linked, nbytes))
            if kind != "collective":  # NCCL's kernels: communication, not compute
                busy["compute"].append((start, start + dur))
            continue
        groups[(kind, name, "")][0].append(start)
        groups[(kind, name, "")][1].append(dur)
        threads[tid] += 1
        cpu_events.append((kind, tid, start, start + dur, corr, name))

    # Busy fractions and Python functions come from the thread that ran the most operators (the
    # training loop's); other threads' Python (the hook's own, the user's) is not the step's work.
    main_tid = threads.most_common(1)[0][0] if threads else None
    mine = [(start, start + dur) for _, tid, start, dur in pending_python if tid == main_tid]
    first = min((b for b, _ in mine), default=0) + _EDGE_NS
    last = max((e for _, e in mine), default=0) - _EDGE_NS
    for pid, tid, start, dur in pending_python:
        # Frames open when the window started and when it ended (the training loop, its callers),
        # or at one edge for most of it, are not executions; a long call within it (a 180 ms
        # garbage collection in a 280 ms window) is.
        opened, closed = start <= first, start + dur >= last
        if tid != main_tid or (opened and closed) or (dur >= window_ns // 2 and (opened or closed)):
            continue
        name, parent = python[pid]
        chain: list[str] = []
        while parent in python and len(chain) < _STACK_DEPTH:
            pname, parent = python[parent]
            chain.append(pname)
        key = (kind_of_python[pid], name, " > ".join(reversed(chain)))
        groups[key][0].append(start)
        groups[key][1].append(dur)

    moved: Counter[tuple[str, str, str]] = Counter()
    if device:
        launchers = _launchers(device, cpu_events, pending_python, python, kind_of_python)
        for kind, name, start, dur, linked, nbytes in device:
            key = (kind, name, launchers.get(linked, ""))
            groups[key][0].append(start)
            groups[key][1].append(dur)
            moved[key] += nbytes

    category = {"op": "compute", "annotation": "compute", "collective": "comm", "dataloader": "data"}
    for kind, tid, s, e_, _, _ in cpu_events:
        if tid == main_tid:
            busy[category[kind]].append((s, e_))

    patterns = [
        pattern(k, nm, st, starts, durs, moved[(k, nm, st)]) for (k, nm, st), (starts, durs) in groups.items()
    ]
    by_op: dict[tuple[str, str], list[CollectiveCall]] = defaultdict(list)
    for c in calls:
        by_op[(f"{c.op}:{c.peer}" if c.peer >= 0 else c.op, c.group)].append(c)  # "recv:2": from rank 2
        if c.blocking:  # an asynchronous one (DDP's buckets) overlaps the thread's other work
            busy["comm"].append((c.enter_ns + epoch_offset_ns, c.enter_ns + epoch_offset_ns + c.dur_ns))
    for (op, group), cs in by_op.items():
        patterns.append(
            pattern(
                "collective",
                f"{op}@{group}",
                "",
                [c.enter_ns + epoch_offset_ns for c in cs],
                [c.dur_ns for c in cs],
                sum(c.nbytes for c in cs),
            )
        )
    patterns.sort(key=lambda p: -p.total_us)

    window = max(window_ns, 1)
    fractions = {k: round(min(1.0, _union_ns(v) / window), 4) for k, v in busy.items()}
    fractions["idle"] = round(max(0.0, 1.0 - _union_ns([i for v in busy.values() for i in v]) / window), 4)
    return _cut(patterns, max_functions), fractions, n


def _launchers(
    device: list[tuple[str, str, int, int, int, int]],
    cpu_events: list[tuple[str, int, int, int, int, str]],
    pending_python: list[tuple[int, int, int, int]],
    python: dict[int, tuple[str, int]],
    kind_of_python: dict[int, str],
) -> dict[int, str]:
    """What launched the device's work, by the correlation id it links to: the CPU operator
    (``aten::mm``), after the innermost function of the job's own code on the operator's thread
    that encloses the operator's start, where the window has Python functions
    (``train.py(40): forward > aten::mm``). An operator outside the window launches nothing here."""
    wanted = {linked for *_, linked, _ in device if linked > 0}
    ops = {corr: (name, tid, start) for _, tid, start, _, corr, name in cpu_events if corr in wanted}
    frames: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
    for pid, tid, start, dur in pending_python:
        if kind_of_python[pid] == "python":
            frames[tid].append((start, start + dur, python[pid][0]))
    points: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for corr, (_, tid, start) in ops.items():
        if tid in frames:
            points[tid].append((start, corr))
    enclosing: dict[int, str] = {}
    for tid, at in points.items():
        enclosing.update(_innermost(frames[tid], at))
    return {
        corr: f"{enclosing[corr]} > {name}" if corr in enclosing else name
        for corr, (name, _, _) in ops.items()
    }


def _innermost(frames: list[tuple[int, int, str]], points: list[tuple[int, int]]) -> dict[int, str]:
    """For each point (time, key), the name of the innermost of one thread's ``frames`` (start,
    end, name: nested, as a thread's calls are) that encloses its time; a point none encloses is
    left out. One sweep over both, sorted: the frames open at a point are a stack."""
    frames.sort(key=lambda f: (f[0], -f[1]))
    out: dict[int, str] = {}
    open_: list[tuple[int, int, str]] = []
    i = 0
    for t, key in sorted(points):
        while i < len(frames) and frames[i][0] <= t:
            while open_ and open_[-1][1] < frames[i][0]:
                open_.pop()
            open_.append(frames[i])
            i += 1
        while open_ and open_[-1][1] < t:
            open_.pop()
        if open_:
            out[key] = open_[-1][2]
    return out


def _cut(patterns: list[FunctionPattern], max_functions: int) -> list[FunctionPattern]:
    """The ``max_functions`` largest ``patterns`` (sorted largest first), and, where some were left
    out, one more of kind ``cut`` that says how many and how large: a function missing from the
    window may have run there, below what was kept (the diagnosis then does not count it absent)."""
    if len(patterns) <= max_functions:
        return patterns
    left = patterns[max_functions:]
    total, largest = sum(p.total_us for p in left), left[0].total_us
    mean = total / len(left)
    cut = FunctionPattern(
        kind=CUT_KIND,
        name="left_out@window",
        stack="",
        count=len(left),
        total_us=round(total, 1),
        mean_us=round(mean, 2),
        p50_us=round(left[len(left) // 2].total_us, 2),
        p90_us=round(left[len(left) // 10].total_us, 2),
        max_us=largest,
        cv=0.0,
        interval_us=0.0,
        interval_cv=0.0,
        nbytes=0,
    )
    return [*patterns[:max_functions], cut]
