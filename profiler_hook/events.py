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

A device's events (kernels, copies, memsets) name the CPU operator that launched them, as torch's
own ``_parse_kineto_results`` links them: a device event's ``linked_correlation_id()`` is the
``correlation_id()`` of the operator (both methods on 2.8, 2.13 and 2.15 here, and on 2.11 by its
method list; a release without them links nothing). Each is asked only of the events it means
something for (60-240 ns a call here), so a CPU-only window pays one call per operator. A copy's bytes
are ``nbytes()`` where it says them (torch fills it for memory allocations only), else the
``"bytes"`` of its kineto metadata (``metadata_json()``, filled where the profiler's experimental
config sets ``expose_kineto_event_metadata``), else 0.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, NamedTuple

_RUNTIME = re.compile(r"^(cuda[A-Z]|cu[A-Z]|Activity Buffer|Lazy Function|Runtime Triggered|Overhead)")
"""The CPU-side names of the CUDA runtime's and driver's calls and of kineto's own overhead (what
2.13+ calls the ``cuda_runtime``, ``cuda_driver`` and ``overhead`` activities); no operator's name
starts so (``aten::``, ``MmBackward0``)."""
DEVICE = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
"""The activities of a device's work, each launched by a CPU operator."""
_LAUNCHERS = frozenset({"cpu_op", "user_annotation"})
"""The CPU events a device's work can be linked to."""
_BYTES = re.compile(r'"bytes": *(\d+)')


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
    correlation_id: int = 0
    """For a CPU operator or annotation, the profiler's id of it (0: none known)..."""
    linked_id: int = 0
    """...and for a device's work (``DEVICE``), the ``correlation_id`` of the CPU operator that
    launched it (0: none known)."""
    nbytes: int = 0
    """For a copy (``gpu_memcpy``), the bytes it moved (0: unknown)."""


_new = tuple.__new__
"""Builds an ``Event`` from all its fields at a quarter of what ``Event(...)`` costs (~120 against
~450 ns here: a NamedTuple's ``__new__`` is a Python function), paid once per event of a window."""


def read(results: Any) -> Iterator[Event]:
    """Every event of a window's results (``prof.profiler.kineto_results``); an event whose name
    cannot be decoded (seen in torch 2.13 for some Python functions) is left out."""
    events = results.events()
    probe = next(iter(events), None)
    typed = probe is not None and hasattr(probe, "python_id") and hasattr(probe, "activity_type")
    linked = hasattr(probe, "correlation_id") and hasattr(probe, "linked_correlation_id")
    sized = (hasattr(probe, "nbytes"), hasattr(probe, "metadata_json"))
    for e in events:
        try:
            name = e.name()
        except UnicodeDecodeError:
            continue
        start, dur, tid = e.start_ns(), e.duration_ns(), e.start_thread_id()
        if typed:
            activity = str(e.activity_type()).rsplit(".", 1)[-1]
            if e.is_python_function():
                yield _new(
                    Event, (name, activity, start, dur, tid, e.python_id(), e.python_parent_id(), 0, 0, 0)
                )
                continue
        else:
            activity = _activity(name, str(e.device_type()), e.is_user_annotation())
        if not linked:
            yield _new(Event, (name, activity, start, dur, tid, -1, -1, 0, 0, 0))
        elif activity in _LAUNCHERS:
            yield _new(Event, (name, activity, start, dur, tid, -1, -1, e.correlation_id(), 0, 0))
        elif activity in DEVICE:
            nbytes = _nbytes(e, *sized) if activity == "gpu_memcpy" else 0
            yield _new(Event, (name, activity, start, dur, tid, -1, -1, 0, e.linked_correlation_id(), nbytes))
        else:
            yield _new(Event, (name, activity, start, dur, tid, -1, -1, 0, 0, 0))
    if not typed:
        yield from _python_calls(results)


def _nbytes(e: Any, nbytes: bool, metadata: bool) -> int:
    """A copy's bytes: ``nbytes()`` where it says them, else its kineto metadata's, else 0."""
    n = e.nbytes() if nbytes else 0
    if n > 0 or not metadata:
        return max(int(n), 0)
    m = _BYTES.search(e.metadata_json() or "")
    return int(m[1]) if m else 0


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
