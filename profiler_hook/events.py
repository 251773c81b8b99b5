"""A profiling window's events, read alike on every supported PyTorch release.

torch.profiler's public ``events()`` builds a ``FunctionEvent`` per event and links them into a
tree in Python: seconds for a window of a real job. So the summarizer reads the profiler's
results object (``prof.profiler.kineto_results``) directly, as PyTorch's own ``events()`` does,
and probes what the release offers:

- 2.13 and later: each kineto event says its activity (``activity_type()``) and, for a Python
  function, its id and its caller's (``is_python_function()``, ``python_id()``,
  ``python_parent_id()``): one pass over ``events()``.
- 2.8 to 2.12 have none of those four methods, and their kineto events hold no Python function at
  all. Python functions come from the profiler's event tree (``experimental_event_tree()``, since
  2.0): its ``PyCall`` and ``PyCCall`` nodes, named as 2.13 names them, on the same clock and
  thread ids. The activity of the other events is told from their device, the user-annotation
  flag and, for the CUDA runtime's and driver's calls on the CPU, their names.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, NamedTuple

_RUNTIME = re.compile(r"^(cuda[A-Z]|cu[A-Z]|Activity Buffer|Lazy Function|Runtime Triggered|Overhead)")
"""The CPU-side names of the CUDA runtime's and driver's calls and of kineto's own overhead (what
2.13+ calls the ``cuda_runtime``, ``cuda_driver`` and ``overhead`` activities); no operator's name
starts so (``aten::``, ``MmBackward0``)."""


class Event(NamedTuple):
    name: str
    activity: str
    """As kineto names it: ``cpu_op``, ``user_annotation``, ``python_function``, ``kernel``,
    ``gpu_memcpy``, ``gpu_memset``, ``cuda_runtime``..."""
    start_ns: int
    """Nanoseconds since the epoch."""
    dur_ns: int
    tid: int
    """The profiler's id of the thread that ran it."""
    python_id: int = -1
    """For a Python function, its id (-1 for any other event)..."""
    parent_id: int = -1
    """...and the id of the Python function that called it (-1: none)."""


def read(results: Any) -> Iterator[Event]:
    """Every event of a window's results (``prof.profiler.kineto_results``); an event whose name
    cannot be decoded (seen in torch 2.13 for some Python functions) is left out."""
    events = results.events()
    probe = next(iter(events), None)
    typed = probe is not None and hasattr(probe, "python_id") and hasattr(probe, "activity_type")
    for e in events:
        try:
            name = e.name()
        except UnicodeDecodeError:
            continue
        start, dur, tid = e.start_ns(), e.duration_ns(), e.start_thread_id()
        if not typed:
            yield Event(name, _activity(name, str(e.device_type()), e.is_user_annotation()), start, dur, tid)
            continue
        activity = str(e.activity_type()).rsplit(".", 1)[-1]
        if e.is_python_function():
            yield Event(name, activity, start, dur, tid, e.python_id(), e.python_parent_id())
        else:
            yield Event(name, activity, start, dur, tid)
    if not typed:
        yield from _python_calls(results)


def _activity(name: str, device: str, annotation: bool) -> str:
    if device.endswith("CPU"):
        if annotation:
            return "user_annotation"
        return "cuda_runtime" if _RUNTIME.match(name) else "cpu_op"
    if annotation:
        return "gpu_user_annotation"
    if name.startswith("Memcpy"):
        return "gpu_memcpy"
    return "gpu_memset" if name.startswith("Memset") else "kernel"


def _python_calls(results: Any) -> Iterator[Event]:
    """The Python functions of the event tree, each with the nearest Python function above it."""
    try:
        from torch._C._profiler import _EventType

        calls = (_EventType.PyCall, _EventType.PyCCall)
        todo = list(results.experimental_event_tree())
    except Exception:  # a release without the tree: the window names operators only
        return
    while todo:
        node = todo.pop()
        todo += node.children
        if node.tag not in calls:
            continue
        parent = node.parent
        while parent is not None and parent.tag not in calls:
            parent = parent.parent
        try:
            name = node.name
        except UnicodeDecodeError:
            continue
        yield Event(
            name,
            "python_function",
            node.start_time_ns,
            node.duration_time_ns,
            node.start_tid,
            node.id,
            parent.id if parent is not None else -1,
        )
