"""A profiling window starts and stops only while no C++ thread is making a Python thread state.

With ``with_stack=True``, torch.profiler's Python tracer sets (at start) and clears (at stop) the
profile function of every Python thread state, walking the interpreter's list of them without the
list's lock. CPython 3.11 and older link a new thread state into that list before initializing it,
so the tracer can reach one that is half made, and crash on it. A C++ thread makes a thread state
each time it takes the GIL without having one, and frees it after.

gloo's worker threads do that in every step of a DDP job: torch's backward pass stashes a
``contextvars.Context`` in the thread-local state that each collective launched during it captures
(every DDP bucket's all-reduce), and the worker that ran one often drops the last reference, so it
takes the GIL to free the context. A 2-rank DDP job of 23 s with a window every 0.5 s lost a
rank to SIGSEGV in 3 runs of 40, on 2 busy cores: the core dumps showed the training thread in
``_PyEval_SetProfile`` under ``PythonTracer::stop`` and a gloo worker in ``PyThreadState_New``
from ``~AsyncAllreduceWork`` (Python 3.11.7, torch 2.13). Python 3.12 links a thread state only
once it is made, and 3.13's tracer sets all threads under the lock.

So, on older Pythons, each stashed context is kept here, and a window starts or stops only once no
C++ object holds one any more (:func:`settle`): the thread that dropped the last such reference
made, used and freed its thread state while holding the GIL, so it is done with it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

NEEDED = sys.version_info < (3, 12)
MAX_HELD = 64
"""Contexts kept at most (an application holding collectives' handles for long holds them too)."""
STABLE_S = 0.005
"""How long contexts held by live owners must stay unchanged to count as settled (see :func:`settle`):
a collective's thread drops its reference microseconds after the collective completes."""

_held: list[Any] = []
_original: Any = None


def _unshared() -> int:
    """``sys.getrefcount`` of an object only ``_held`` holds, seen as :func:`_shared` sees it."""
    probe = [object()]
    return [sys.getrefcount(c) for c in probe][0]  # noqa: RUF015 (the very same references)


_UNSHARED = _unshared()


def _shared() -> list[Any]:
    """The kept contexts that something else (a C++ object of a collective) still holds."""
    return [c for c in _held if sys.getrefcount(c) > _UNSHARED]


def install() -> bool:
    """Keep every context torch's backward pass stashes (idempotent); False where not needed or
    this torch stashes none."""
    global _original
    if not NEEDED:
        return False
    if _original is not None:
        return True
    try:
        import torch

        original = torch._C._stash_obj_in_tls
    except Exception:
        return False

    def stash(key: str, arg: Any) -> None:
        original(key, arg)
        if key == "context":
            if len(_held) >= MAX_HELD:
                _held[:] = _shared()[-(MAX_HELD - 1) :]
            _held.append(arg)

    torch._C._stash_obj_in_tls = stash
    _original = original
    # Releases before 2.13 stash nothing in the backward pass (their collectives hold no Python
    # object): one tiny backward pass tells, and there is then nothing to keep.
    try:
        with torch.enable_grad():
            torch.ones(1, requires_grad=True, device="cpu").sum().backward()
    except Exception:  # no backward pass here (inference mode, say): keep what may be stashed
        return True
    if not _held:
        uninstall()
        return False
    _held.clear()
    return True


def uninstall() -> None:
    global _original
    if _original is None:
        return
    import torch

    torch._C._stash_obj_in_tls = _original
    _original = None
    _held.clear()


def settle(timeout_s: float, quiet: Callable[[], bool] = lambda: False) -> bool:
    """True once no C++ object holds a stashed context (waiting up to ``timeout_s``, asleep so that
    the thread that holds one can take the GIL and drop it); then none is kept any more.

    Also True once those that still hold one have held it unchanged (the same contexts, the same
    reference counts) for ``STABLE_S`` while ``quiet()`` says no collective is in flight: their
    owners live on, and no collective's thread is about to drop one. DDP built with
    ``find_unused_parameters=True`` (as the Hugging Face Trainer builds it) keeps the last backward
    pass's all-reduce of its used-parameter map until the next backward pass, which frees it on
    the training thread: with no such exception, no window of such a job ever started."""
    start = time.monotonic()
    seen: list[tuple[int, int]] = []
    since = start
    while True:
        _held[:] = _shared()
        if not _held:
            return True
        now = time.monotonic()
        held = [(id(c), sys.getrefcount(c)) for c in _held]
        if held != seen:
            seen, since = held, now
        elif now - since >= STABLE_S and quiet():
            return True
        if now - start >= timeout_s:
            return False
        time.sleep(0.0005)
