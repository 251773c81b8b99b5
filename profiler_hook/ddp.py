"""DDP's gradient all-reduces, made visible to the always-on collective tracking — with no Python
per bucket and DDP's own C++ all-reduce (or the user's communication hook) left in place.

DDP's reducer launches each bucket's all-reduce from C++ as the backward pass makes its gradients
ready, queues ``finalize_backward`` on the autograd engine once the last bucket is launched, and
there waits for all of them. So, per backward pass, two engine callbacks around that wait time it:

- a hook on the gradient of two of the model's parameters (the first and the last: one of them is
  computed in any step that uses the model) queues the first callback; queued before DDP's
  finalizer, it runs when the backward pass's own work has ended (all buckets launched: the rank's
  arrival at the synchronization);
- that callback queues a second one, which runs after DDP's finalizer: the buckets are complete.

The time between the two is what the backward pass waited (for the last rank, and the transfer).
The buckets are counted and numbered as every collective launched from C++ is, from c10d's
sequence number at each step block's end (:meth:`CollectiveTracker.catch_up`): not read here,
where it cost ~17 µs a step inside a training step. Per step that is three Python calls, where
a communication hook makes one per bucket and adds a division and a copy of every bucket, which
DDP's C++ path fuses away (measured: a Python hook costs +2–4% at 12 ms steps; `benchmarks`).

A user's own communication hook (fp16 compression, PowerSGD) is untouched; its ``torch.distributed``
calls are tracked by the wrapped functions, and the wait is measured here as for DDP's own.
On NCCL, ``finalize_backward`` makes the compute stream wait rather than the CPU, so the wait it
measures is the CPU's only; counts and sequence numbers are exact on every backend that numbers
its collectives (gloo, NCCL).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .collectives import CollectiveCall, CollectiveTracker, group_name

log = logging.getLogger(__name__)


def patch(tracker: CollectiveTracker) -> bool:
    """Install on ``DistributedDataParallel`` (idempotent); False if DDP is unavailable."""
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP
    except Exception:
        return False
    if getattr(DDP.__init__, "__rankscope_original__", None) is not None:
        return True
    init = DDP.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        try:
            Sync(self, tracker)
        except Exception as exc:  # the model trains as it would without us
            log.warning("rankscope: DDP's all-reduces are not tracked (%s: %s)", type(exc).__name__, exc)

    __init__.__rankscope_original__ = init  # type: ignore[attr-defined]
    __init__.__doc__, __init__.__wrapped__ = init.__doc__, init  # type: ignore[attr-defined]
    DDP.__init__ = __init__  # type: ignore[method-assign]
    return True


def unpatch() -> None:
    """Models built before stay hooked, inert while the tracker is unpatched."""
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP
    except Exception:
        return
    original = getattr(DDP.__init__, "__rankscope_original__", None)
    if original is not None:
        DDP.__init__ = original  # type: ignore[method-assign]


class Sync:
    """One DDP model's gradient synchronization, timed once per backward pass."""

    def __init__(self, model: Any, tracker: CollectiveTracker) -> None:
        import torch

        params = [p for p in model.module.parameters() if p.requires_grad]
        if not params:
            return
        self.tracker = tracker
        self.group = group_name(model.process_group)
        self.nbytes = sum(p.numel() * p.element_size() for p in params)
        self.engine = torch.autograd.Variable._execution_engine
        self.armed = -1
        """The tracker's step count when a callback was queued for this backward pass (-1: none);
        a pass that raised never runs its callbacks, so the next step arms again."""
        self.call: CollectiveCall | None = None
        for p in {id(p): p for p in (params[0], params[-1])}.values():
            p.register_hook(self._grad_ready)

    def _grad_ready(self, grad: Any) -> None:
        if self.armed == self.tracker.steps or not self.tracker.active:
            return
        try:
            self.armed = self.tracker.steps
            self.engine.queue_callback(self._backward_done)
        except Exception:  # outside an engine run (a hook called by hand): nothing to time
            self.armed = -1

    def _backward_done(self) -> None:
        """Before DDP's finalizer: every bucket launched."""
        self.armed = -1  # the pass's hooks have all run: the next pass arms again
        try:
            self.call = self.tracker.sync(self.group, self.nbytes, time.perf_counter_ns())
            self.engine.queue_callback(self._synchronized)
        except Exception:  # tracking must never fail the backward pass
            self.call = None

    def _synchronized(self) -> None:
        """After DDP's finalizer: every bucket complete."""
        call, self.call = self.call, None
        if call is not None:
            self.tracker.exit(call)
