"""NCCL collectives timed on the GPU, always on, DDP's C++ bucket all-reduces included.

On NCCL a collective returns to the CPU as soon as it is queued on c10d's stream, and DDP's
finalizer makes the compute stream wait for the buckets rather than the CPU: the waits the CPU
sees are near zero on every rank, and a late peer shows nowhere. Its GPU side does show: an NCCL
kernel spins until its peers arrive, so its time is this rank's wait for the last rank plus the
transfer, and the rank that arrives last has the shortest — the same inversion the CPU path reads
on gloo, so the step rows carry it the same way (``StepRow.comm_us``).

The mechanism is c10d's own completion hook (``ProcessGroup._register_on_completion_hook``, torch
1.13 to 2.15 at least): once timing is on for a group (``_enable_collectives_timing()``, also for
a group made before ``attach``), c10d records a CUDA event before and after each collective, and,
when one completes, calls a Python function on its hook thread with the collective's
``active_duration`` (the GPU time between the two events), ``seq`` and ``op_type``. The training
thread pays nothing but the two sums it reads per step (:meth:`CollectiveTracker.take_step`); the
CUDA events are c10d's, the Python call one per collective on c10d's thread. (A ``.then`` on an
NCCL work's future fires at launch, not completion; Flight Recorder would need a dump per read.)

Two hazards of the hook decide how it is installed:

- c10d aborts every communicator of a group whose hook raises, and a collective launched before
  timing was on throws when it completes with the hook registered (it has no events). So timing is
  switched on when a group is first seen, the hook is registered only once the rank has finished
  ``SETTLE_STEPS`` steps and ``SETTLE_S`` seconds have passed since (what was launched before has
  completed and been retired), and the hook itself catches everything.
- A group has one hook at most: a group that has one already (the user's, another tool's) is left
  as it is, and the rank record says so. Ours forwards to the hook attached now, so a process that
  attaches again (a second hook after ``close``) keeps the groups timed.

At ``close`` the hook waits (briefly) for the collectives still pending, so that none completes
into a Python that is shutting down; it cannot be unregistered, so after ``close`` it only returns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)

SETTLE_STEPS = 2
SETTLE_S = 2.0
"""Steps finished and seconds passed between switching a group's timing on and registering its hook."""
CLOSE_WAIT_S = 2.0
"""At close, how long to wait for the collectives still pending on the timed groups."""

Groups = Callable[[], Iterable[tuple[str, str, Any]]]
"""(name, backend, process group) of every group of this rank."""

_current: NcclTiming | None = None
"""The timing the registered hooks forward to (the hook attached now)."""
_hooked: dict[int, Any] = {}
"""Each group our hook is registered on, by ``id`` (held: an id is not reused while it lives)."""


def _forward(info: Any) -> None:
    """The hook c10d calls on its hook thread: must never raise (c10d would abort the group)."""
    try:
        if (timing := _current) is not None:
            timing.completed(info)
    except Exception:  # raising here aborts the job's communicators
        pass


def nccl_groups() -> list[tuple[str, str, Any]]:
    """(name, backend, group) of this rank's process groups whose backend is NCCL (for any device)."""
    from .collectives import group_name

    try:
        from torch.distributed import distributed_c10d

        world = distributed_c10d._world
        groups = [(group_name(pg), str(world.pg_map[pg][0]), pg) for pg in list(world.pg_names)]
    except Exception:  # no torch.distributed, or a group changed meanwhile
        return []
    return [g for g in groups if "nccl" in g[1]]


class NcclTiming:
    """Times every NCCL group's collectives on the GPU (see the module's docstring). ``add`` is
    called with each completed collective's GPU time in ns; ``steps`` says how many steps the rank
    has finished. :meth:`scan` (at attach and at each heartbeat) finds new groups and moves each on."""

    def __init__(
        self, add: Callable[[int], None], steps: Callable[[], int], groups: Groups | None = None
    ) -> None:
        self._add, self._steps, self._groups = add, steps, groups or nccl_groups
        self.active = True
        """False after :meth:`close`: the hooks, which cannot be removed, only return."""
        self._state: dict[str, str] = {}
        """Per group name: what is timed (said in :meth:`coverage`)."""
        self.timed: set[str] = set()
        """The groups whose collectives are timed on the GPU, or will be in a few steps."""
        self._pending: dict[str, tuple[Any, str, int, float]] = {}
        """Groups whose timing is on and whose hook waits: (group, backend, steps then, time then)."""
        self._timed: list[Any] = []
        self._lock = threading.Lock()

    def scan(self) -> None:
        """Switch timing on for the NCCL groups made since the last scan; register the hook of the
        groups whose timing has been on long enough. Never raises."""
        global _current
        try:
            groups = list(self._groups())
        except Exception:
            return
        if groups and self.active:
            _current = self
        steps, now = self._steps(), time.monotonic()
        for name, backend, pg in groups:
            if name in self._state:
                continue
            if _hooked.get(id(pg)) is pg:  # by an earlier hook of this process
                self._timed_now(name, backend, pg)
                continue
            try:
                if pg._has_hooks():
                    self._state[name] = _untracked(name, backend, "another completion hook")
                    continue
                pg._enable_collectives_timing()
            except Exception as exc:  # a torch without either: the CPU's view only
                self._state[name] = _untracked(name, backend, f"{type(exc).__name__}: {exc}")
                continue
            self._state[name] = f"group {name} ({backend}): GPU time from a few steps on"
            self.timed.add(name)
            self._pending[name] = (pg, backend, steps, now)
        for name, (pg, backend, since_steps, since) in list(self._pending.items()):
            if steps - since_steps < SETTLE_STEPS or now - since < SETTLE_S:
                continue
            del self._pending[name]
            try:
                pg._register_on_completion_hook(_forward)
            except Exception as exc:  # registered meanwhile by someone else, say
                self._state[name] = _untracked(name, backend, f"{type(exc).__name__}: {exc}")
                self.timed.discard(name)
                continue
            _hooked[id(pg)] = pg
            self._timed_now(name, backend, pg)

    def _timed_now(self, name: str, backend: str, pg: Any) -> None:
        with self._lock:
            self._timed.append(pg)
        self.timed.add(name)
        self._state[name] = f"group {name} ({backend}): collectives timed on the GPU"

    def completed(self, info: Any) -> None:
        """One collective completed (a ``WorkInfo``): add its GPU time, unless closed."""
        if self.active:
            self._add(int(info.active_duration.total_seconds() * 1e9))

    def coverage(self) -> list[str]:
        """What is timed of each NCCL group, in the order they were found."""
        return list(self._state.values())

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Stop adding; wait up to ``timeout`` seconds for the timed groups' pending collectives."""
        with self._lock:
            timed, self._timed = self._timed, []
        if timed:
            t = threading.Thread(
                target=_wait_pending, args=(timed,), name="rankscope-nccl-close", daemon=True
            )
            t.start()
            t.join(timeout)
        self.active = False
        global _current
        if _current is self:
            _current = None


def _untracked(name: str, backend: str, why: str) -> str:
    return f"group {name} ({backend}): GPU time not tracked ({why})"


def _wait_pending(groups: list[Any]) -> None:
    for pg in groups:
        try:
            pg._wait_for_pending_works()
        except Exception as exc:  # a group destroyed meanwhile
            log.debug("rankscope: waiting for a group's pending collectives: %s", exc)
