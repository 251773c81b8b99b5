"""GPU windows: a device's kernels, copies and NCCL kernels named by the operator that launched them.

No GPU is at hand here, so the GPU windows below are recorded by hand: fake kineto events built from
the method lists of ``torch._C._autograd._KinetoEvent`` (torch 2.11's, read on a GPU machine; 2.13's
and 2.15's, read here), holding what a CUDA window holds. They stand in for the part that cannot run
here; the reading of a real CPU window on every release is tested as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from rankscope.diagnosis.detectors.straggler import functions as fn
from rankscope.profiler_hook import events
from rankscope.profiler_hook.summarize import summarize

pytestmark = pytest.mark.releases  # on every release's torch: its DeviceType, its event tree's tags

T0 = 1_790_000_000_000_000_000
"""The window's start, in nanoseconds since the epoch."""
WINDOW_NS = 2_000_000
MAIN, AUTOGRAD, STREAM = 11, 12, 7
"""The training thread, the autograd engine's thread (no Python functions on it) and the CUDA stream."""

M2_11 = (  # noqa: SIM905
    "correlation_id cuda_elapsed_us device_index device_resource_id device_type duration_ns end_ns "
    "end_thread_id fwd_thread_id is_async is_hidden_event is_user_annotation linked_correlation_id "
    "metadata_json name nbytes scope sequence_nr shapes stack start_ns start_thread_id"
).split()
"""torch 2.11's ``_KinetoEvent`` methods (``dir()`` on a GPU machine): no activity type, no Python
functions among the events."""
M2_15 = (  # noqa: SIM905
    "activity_type concrete_inputs correlation_id cuda_elapsed_us device_index device_resource_id "
    "device_type dtypes duration_ns end_ns end_thread_id external_id extra_meta flops flow_id flow_start "
    "flow_type fwd_thread_id is_async is_hidden_event is_python_function is_user_annotation kwinputs "
    "linked_correlation_id metadata_json name nbytes overload_name privateuse1_elapsed_us python_id "
    "python_module_id python_parent_id scope sequence_nr shapes stack start_ns start_thread_id "
    "structured_input_shapes structured_input_strides typed_metadata"
).split()
"""torch 2.15's (2.13's lacks ``typed_metadata`` only)."""


@dataclass
class Rec:
    """One recorded event, as the 2.13+ kineto event says it."""

    name: str
    activity: str
    start: int
    dur: int
    tid: int
    corr: int = 0
    linked: int = 0
    py_id: int = -1
    py_parent: int = -1
    metadata: str = ""


US = 1_000
LIBRARY = "torch/nn/modules/module.py(1751): _call_impl"
BUILTIN = "<built-in method mm of type object at 0x7f00>"
PYTHON = [
    Rec("train.py(90): main", "python_function", T0, WINDOW_NS, MAIN, py_id=1),
    Rec(LIBRARY, "python_function", T0 + 50 * US, 550 * US, MAIN, py_id=2, py_parent=1),
    Rec("train.py(40): forward", "python_function", T0 + 80 * US, 500 * US, MAIN, py_id=3, py_parent=2),
    Rec(BUILTIN, "python_function", T0 + 95 * US, 65 * US, MAIN, py_id=4, py_parent=3),
]
MEMCPY = "Memcpy HtoD (Pageable -> Device)"
MEMCPY_METADATA = (
    '"device": 0, "context": 1, "stream": 7, "correlation": 2001, "bytes": 4096, '
    '"memory bandwidth (GB/s)": 0.2'
)
"""What kineto's ``metadataJson()`` says of a CUDA copy (``GpuActivity<CUpti_ActivityMemcpy>``)."""
SGEMM = "ampere_sgemm_128x64_nn"
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
KINETO = [
    Rec("ProfilerStep#3", "user_annotation", T0 + 5 * US, 1_990 * US, MAIN, corr=5),
    Rec("aten::copy_", "cpu_op", T0 + 20 * US, 30 * US, MAIN, corr=11),
    Rec("cudaMemcpyAsync", "cuda_runtime", T0 + 25 * US, 10 * US, MAIN, corr=2001, linked=11),
    Rec(MEMCPY, "gpu_memcpy", T0 + 40 * US, 20 * US, STREAM, corr=2001, linked=11, metadata=MEMCPY_METADATA),
    Rec("aten::mm", "cpu_op", T0 + 100 * US, 50 * US, MAIN, corr=7),
    Rec("cudaLaunchKernel", "cuda_runtime", T0 + 110 * US, 10 * US, MAIN, corr=2002, linked=7),
    Rec(SGEMM, "kernel", T0 + 130 * US, 400 * US, STREAM, corr=2002, linked=7),
    Rec("aten::addmm", "cpu_op", T0 + 700 * US, 40 * US, MAIN, corr=9),
    Rec("cudaLaunchKernel", "cuda_runtime", T0 + 710 * US, 10 * US, MAIN, corr=2003, linked=9),
    Rec(SGEMM, "kernel", T0 + 720 * US, 300 * US, STREAM, corr=2003, linked=9),
    Rec("record_param_comms", "cpu_op", T0 + 800 * US, 60 * US, MAIN, corr=13),
    Rec("cudaLaunchKernel", "cuda_runtime", T0 + 810 * US, 10 * US, MAIN, corr=2004, linked=13),
    Rec(NCCL, "kernel", T0 + 1_200 * US, 300 * US, STREAM, corr=2004, linked=13),
    Rec("aten::mm", "cpu_op", T0 + 1_050 * US, 40 * US, AUTOGRAD, corr=15),  # backward: no Python there
    Rec("cudaLaunchKernel", "cuda_runtime", T0 + 1_060 * US, 10 * US, AUTOGRAD, corr=2005, linked=15),
    Rec(SGEMM, "kernel", T0 + 1_600 * US, 100 * US, STREAM, corr=2005, linked=15),
    # Launched before the window opened: its operator is not in it.
    Rec("vectorized_elementwise_kernel", "kernel", T0 + 1 * US, 3 * US, STREAM, corr=1999, linked=3),
]


class FakeEvent:
    """A kineto event that answers the methods of ``methods`` only, from a :class:`Rec`."""

    def __init__(self, r: Rec, methods: list[str]) -> None:
        self.r = r
        gpu = r.activity in ("kernel", "gpu_memcpy", "gpu_memset")
        answers = {
            "name": r.name,
            "activity_type": r.activity,
            "start_ns": r.start,
            "duration_ns": r.dur,
            "end_ns": r.start + r.dur,
            "start_thread_id": r.tid,
            "end_thread_id": r.tid,
            "device_type": DeviceType.CUDA if gpu else DeviceType.CPU,
            "device_resource_id": r.tid,
            "is_user_annotation": r.activity == "user_annotation",
            "is_python_function": r.py_id >= 0,
            "python_id": r.py_id,
            "python_parent_id": r.py_parent,
            "correlation_id": r.corr,
            "linked_correlation_id": r.linked,
            "nbytes": 0,  # torch fills it for memory allocations only
            "metadata_json": r.metadata,
        }
        for m in methods:
            setattr(self, m, (lambda v: lambda: v)(answers.get(m, 0)))


@dataclass
class Node:
    """A node of ``experimental_event_tree()``: 2.8-2.12 hold the Python functions there."""

    tag: Any
    name: str
    start_time_ns: int
    duration_time_ns: int
    start_tid: int
    id: int
    parent: Node | None = None
    children: list[Node] = field(default_factory=list)


class FakeResults:
    """``prof.profiler.kineto_results`` of a GPU window."""

    def __init__(self, recs: list[Rec], methods: list[str], tree: list[Rec] | None = None) -> None:
        self._events = [FakeEvent(r, methods) for r in recs]
        self._tree = tree

    def events(self) -> list[FakeEvent]:
        return self._events

    def experimental_event_tree(self) -> list[Node]:
        if self._tree is None:
            raise RuntimeError("no Python functions recorded")
        from torch._C._profiler import _EventType

        nodes = {r.py_id: Node(_EventType.PyCall, r.name, r.start, r.dur, r.tid, r.py_id) for r in self._tree}
        for r in self._tree:
            if r.py_parent in nodes:
                nodes[r.py_id].parent = nodes[r.py_parent]
                nodes[r.py_parent].children.append(nodes[r.py_id])
        return [n for n in nodes.values() if n.parent is None]


def by_key(results: FakeResults) -> tuple[dict[tuple[str, str, str], Any], dict[str, float]]:
    patterns, busy, _ = summarize(results, [], WINDOW_NS, max_functions=300)
    return {(p.kind, p.name, p.stack): p for p in patterns}, busy


def union_us(*spans: tuple[int, int]) -> float:
    """Microseconds covered by ``spans`` (start, duration in µs after T0)."""
    covered = set()
    for start, dur in spans:
        covered |= set(range(start, start + dur))
    return float(len(covered))


COMPUTE = [(20, 30), (100, 50), (700, 40), (40, 20), (130, 400), (720, 300), (1_600, 100), (1, 3)]
"""Operators on the training thread, and the device's kernels and copies; not NCCL's kernel."""
COMM = (800, 60)
"""``record_param_comms``."""
EXPECTED_BUSY = {
    "compute": round(union_us(*COMPUTE) * US / WINDOW_NS, 4),
    "comm": round(60 * US / WINDOW_NS, 4),  # record_param_comms
    "data": 0.0,
    "idle": round(1 - union_us(*COMPUTE, COMM) * US / WINDOW_NS, 4),
}


@pytest.mark.parametrize("release", ["2.11", "2.15"])
def test_a_devices_work_is_named_by_the_operator_and_the_jobs_function_that_launched_it(release: str) -> None:
    """2.11 (Python functions in the event tree) and 2.15 (among the kineto events) alike: each
    kernel and copy is named by its operator, after the innermost function of the job's own code
    around it on the operator's thread (a library's frames and built-ins skipped); the same kernel
    launched by two operators is two patterns; NCCL's kernel is a collective; a copy says its bytes."""
    if release == "2.11":
        results = FakeResults(KINETO, M2_11, tree=PYTHON)
    else:
        results = FakeResults(sorted(KINETO + PYTHON, key=lambda r: r.start), M2_15)
    got, busy = by_key(results)
    forward, main = "train.py(40): forward", "train.py(90): main"
    assert got[("kernel", SGEMM, f"{forward} > aten::mm")].count == 1
    assert got[("kernel", SGEMM, f"{main} > aten::addmm")].count == 1
    assert got[("kernel", SGEMM, "aten::mm")].total_us == 100.0  # the autograd thread has no Python
    assert got[("kernel", "vectorized_elementwise_kernel", "")].count == 1  # its operator ran before
    copy = got[("memcpy", MEMCPY, f"{main} > aten::copy_")]
    assert (copy.count, copy.nbytes) == (1, 4096)
    nccl = got[("collective", NCCL, f"{main} > record_param_comms")]
    assert (nccl.count, nccl.total_us) == (1, 300.0)
    assert not [k for k in got if k[1] in (SGEMM, MEMCPY, NCCL) and k[2] == ""]
    # Operators, and the job's Python functions, as before.
    assert got[("op", "aten::mm", "")].count == 2 and ("collective", "record_param_comms", "") in got
    assert ("python", forward, f"{main} > {LIBRARY}") in got
    assert not [k for k in got if "cuda" in k[1]]  # the runtime's calls are no functions of the job
    assert busy == EXPECTED_BUSY


def test_both_releases_summarize_a_gpu_window_alike_and_without_python_name_the_operator_only() -> None:
    typed = summarize(FakeResults(sorted(KINETO + PYTHON, key=lambda r: r.start), M2_15), [], WINDOW_NS, 300)
    untyped = summarize(FakeResults(KINETO, M2_11, tree=PYTHON), [], WINDOW_NS, 300)
    assert sorted(typed[0]) == sorted(untyped[0]) and typed[1:] == untyped[1:]
    # A window without Python functions (a periodic one; or a tree that cannot be read).
    for results in (FakeResults(KINETO, M2_11), FakeResults(KINETO, M2_15)):
        got, busy = by_key(results)
        assert got[("kernel", SGEMM, "aten::mm")].count == 2  # forward's and backward's, one operator
        assert got[("kernel", SGEMM, "aten::addmm")].count == 1
        assert got[("memcpy", MEMCPY, "aten::copy_")].nbytes == 4096
        assert ("collective", NCCL, "record_param_comms") in got
        assert busy == EXPECTED_BUSY


def test_a_release_without_correlation_ids_names_no_launcher_and_does_not_fail() -> None:
    old = [m for m in M2_11 if m not in ("correlation_id", "linked_correlation_id", "metadata_json")]
    got, busy = by_key(FakeResults(KINETO, old, tree=PYTHON))
    assert got[("kernel", SGEMM, "")].count == 3
    assert got[("memcpy", MEMCPY, "")].nbytes == 0  # unknown
    assert ("collective", NCCL, "") in got
    assert busy == EXPECTED_BUSY


def test_every_operator_of_a_real_window_carries_its_correlation_id() -> None:
    """What links a device's work to its operator, on the release under test: each CPU operator's
    correlation id (a CPU window has no device work to link)."""
    model = torch.nn.Linear(16, 4)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(3):
            model(torch.randn(8, 16)).sum().backward()
    read = list(events.read(prof.profiler.kineto_results))
    ops = [e for e in read if e.activity == "cpu_op"]
    assert len(ops) > 10
    assert all(e.correlation_id > 0 for e in ops) and len({e.correlation_id for e in ops}) == len(ops)
    assert not [e for e in read if e.linked_id or e.nbytes]
    assert all(e.correlation_id == 0 for e in read if e.activity == "python_function")


def window_rows(stack_of: dict[int, str], culprit_us: float) -> pd.DataFrame:
    """Four ranks' two windows of 5 steps: ``aten::mm``'s kernel, 5 calls a window, 1 ms a step on
    the peers and ``culprit_us`` a step on rank 3; window 1 recorded Python functions, window 0 not."""
    rows = []
    for rank in range(4):
        for w, stack in stack_of.items():
            total = 5 * (culprit_us if rank == 3 else 1_000.0)
            rows.append(
                {"rank": rank, "window": w, "step_lo": 10 * w, "step_hi": 10 * w + 5, "kind": "kernel"}
                | {"name": SGEMM, "stack": stack, "count": 5, "total_us": total, "p50_us": total / 5}
                | {"mean_us": total / 5, "max_us": total / 5}
            )
        rows.append(
            {"rank": rank, "window": 1, "step_lo": 10, "step_hi": 15, "kind": "python"}
            | {"name": "train.py(40): forward", "stack": "train.py(90): main", "count": 5}
            | {"total_us": 6_000.0, "p50_us": 1_200.0, "mean_us": 1_200.0, "max_us": 1_200.0}
        )
    return pd.DataFrame(rows)


def test_the_diagnosis_compares_a_kernel_by_its_operator_in_windows_with_and_without_python() -> None:
    """A kernel is named ``train.py(40): forward > aten::mm`` in the windows that record Python
    functions and ``aten::mm`` in the others: compared as one, it holds all of the culprit's excess
    (1 ms a step), not half of it in each of two rows."""
    split = window_rows({0: "aten::mm", 1: "train.py(40): forward > aten::mm"}, culprit_us=2_000.0)
    alike = window_rows({0: "aten::mm", 1: "aten::mm"}, culprit_us=2_000.0)
    kernels = [[e for e in fn.compare(f, 3, [0, 1, 2]) if e.kind == "kernel"] for f in (split, alike)]
    assert kernels[0] == kernels[1]
    (k,) = kernels[0]
    assert (k.name, k.stack, k.rank_us, k.peer_us, k.extra) == (SGEMM, "aten::mm", 2_000.0, 1_000.0, False)
    assert fn.top_slower(fn.compare(split, 3, [0, 1, 2])) == k
