"""DDP's gradient all-reduces, made visible to the always-on collective tracking — with no Python
per bucket and DDP's own C++ all-reduce (or the user's communication hook) left in place.

Every DDP model of the process is found, whichever side of ``attach`` it was built on: those that
exist at attach by one scan of the garbage collector's objects (users add a monitoring hook where
their loop is, after ``DistributedDataParallel(model)``), those built later by a wrapper of
``DistributedDataParallel.__init__``. Subclasses and the frameworks' wrappers (Lightning's, the
Hugging Face Trainer's) are DDP instances too.

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

import gc
import logging
import threading
import time
import weakref
from typing import Any

from .collectives import CollectiveCall, CollectiveTracker, group_name

log = logging.getLogger(__name__)


def _ddp_class() -> Any:
    try:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel
    except Exception:  # a torch built without distributed
        return None


class Watch:
    """Every DDP model of this process, each one's gradient synchronization timed; what it holds
    says, per model, what is timed (:meth:`coverage`). One per hook; :meth:`stop` lets go of them all."""

    def __init__(self, tracker: CollectiveTracker) -> None:
        self.tracker = tracker
        self._syncs: dict[int, Sync] = {}
        """By model ``id``, while the model lives."""
        self._said: list[str] = []
        """What is timed of each model found (``"DDP GPT on world: timed per backward pass"``),
        each statement once; a model freed stays said (the store keeps a rank's latest record)."""
        self._lock = threading.Lock()
        self._patched = False

    def start(self) -> bool:
        """Time every DDP model that exists now and every one built from now on; False where this
        torch has no DDP."""
        ddp = _ddp_class()
        if ddp is None:
            return False
        if getattr(ddp.__init__, "__rankscope_original__", None) is None:
            init, watch = ddp.__init__, self

            def __init__(model: Any, *args: Any, **kwargs: Any) -> None:
                init(model, *args, **kwargs)
                watch.add(model)

            __init__.__rankscope_original__ = init  # type: ignore[attr-defined]
            __init__.__doc__, __init__.__wrapped__ = init.__doc__, init  # type: ignore[attr-defined]
            ddp.__init__ = __init__
            self._patched = True
        # The types, not isinstance(): that reads each object's ``__class__``, which some objects
        # compute (torch.distributed's deprecated ``reduce_op`` warns there), and costs 3x as much
        # (0.16 s against 0.05 s for the 375,000 objects of a process with transformers' GPT-2).
        kinds, todo = set(), [ddp]
        while todo:
            kinds.add(kind := todo.pop())
            todo += kind.__subclasses__()
        for model in [o for o in gc.get_objects() if type(o) in kinds]:
            self.add(model)
        return True

    def add(self, model: Any) -> None:
        """Time ``model``'s synchronization (once however often it is added); never raises."""
        key = id(model)
        if key in self._syncs:
            return
        label = "DDP"
        try:
            label = _label(model)
            sync = Sync(model, self.tracker)
        except Exception as exc:  # the model trains as it would without us
            self._say(f"{label}: not tracked ({type(exc).__name__}: {exc})")
            log.warning("rankscope: %s: not tracked (%s: %s)", label, type(exc).__name__, exc)
            return
        with self._lock:
            self._syncs[key] = sync
        self._say(f"{label}: timed per backward pass" if sync.handles else f"{label}: no gradients")
        weakref.finalize(model, self._forget, key)

    def _say(self, statement: str) -> None:
        with self._lock:
            if statement not in self._said:
                self._said.append(statement)

    def _forget(self, key: int) -> None:
        with self._lock:
            self._syncs.pop(key, None)

    def coverage(self) -> list[str]:
        """What is timed of each DDP model found, in the order they were found (any thread)."""
        with self._lock:
            return list(self._said)

    def stop(self) -> None:
        """Unwrap DDP's constructor and remove our hooks from every model: they train on untouched."""
        ddp = _ddp_class()
        if self._patched and ddp is not None:
            original = getattr(ddp.__init__, "__rankscope_original__", None)
            if original is not None:
                ddp.__init__ = original
            self._patched = False
        with self._lock:
            syncs, self._syncs = list(self._syncs.values()), {}
            self._said.clear()
        for sync in syncs:
            sync.remove()


def _label(model: Any) -> str:
    inner = getattr(model, "module", model)
    return f"DDP {type(inner).__name__} on {group_name(getattr(model, 'process_group', None))}"


class Sync:
    """One DDP model's gradient synchronization, timed once per backward pass."""

    def __init__(self, model: Any, tracker: CollectiveTracker) -> None:
        import torch

        self.handles: list[Any] = []
        params = [p for p in model.module.parameters() if p.requires_grad]
        if not params:
            return
        self.tracker = tracker
        self.model = weakref.ref(model)
        self.group = group_name(model.process_group)
        self.nbytes = sum(p.numel() * p.element_size() for p in params)
        self.engine = torch.autograd.Variable._execution_engine
        self.armed = -1
        """The tracker's step count when a callback was queued for this backward pass (-1: none);
        a pass that raised never runs its callbacks, so the next step arms again."""
        self.call: CollectiveCall | None = None
        for p in {id(p): p for p in (params[0], params[-1])}.values():
            self.handles.append(p.register_hook(self._grad_ready))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _grad_ready(self, grad: Any) -> None:
        if self.armed == self.tracker.steps or not self.tracker.active:
            return
        model = self.model()
        if model is None or not model.require_backward_grad_sync:  # no_sync(): gradient accumulation
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
