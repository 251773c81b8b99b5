"""DDP's gradient all-reduces, made visible to the always-on collective tracking.

DDP's reducer launches its bucket all-reduces from C++, past every Python wrapper. A DDP
communication hook is the one public place each bucket passes through on every backend, so the
hook gives every ``DistributedDataParallel`` built after :func:`patch` a communication hook of its
own: the average of PyTorch's reference ``allreduce_hook`` (PyTorch documents that DDP's results
are the same with it), issued straight to the process group — past ``dist.all_reduce``'s Python
checks, which cost more than the rest — and timed by
:class:`~profiler_hook.collectives.CollectiveTracker` from launch to completion.

A user's own hook keeps working: ``register_comm_hook`` and ``_register_builtin_comm_hook`` on a
patched model put the user's hook in ours' place (DDP accepts only one registration), so that
fp16 compression, PowerSGD and the like run as they would without rankscope. Their collectives
are tracked whenever they go through ``torch.distributed``'s Python functions, as PyTorch's do.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

from .collectives import CollectiveTracker, group_name

log = logging.getLogger(__name__)
_SLOT = "_rankscope_comm_hook"


def patch(tracker: CollectiveTracker) -> bool:
    """Install on ``DistributedDataParallel`` (idempotent); False if DDP is unavailable."""
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP
    except Exception:
        return False
    if getattr(DDP.__init__, "__rankscope_original__", None) is not None:
        return True
    init, register, builtin = DDP.__init__, DDP.register_comm_hook, DDP._register_builtin_comm_hook

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        try:
            _install(self, register, tracker)
        except Exception as exc:  # the model trains as it would without us
            log.warning("rankscope: DDP's all-reduces are not tracked (%s: %s)", type(exc).__name__, exc)

    def register_comm_hook(self: Any, state: object, hook: Any) -> None:
        slot = getattr(self, _SLOT, None)
        if slot is None or slot["user"]:
            return register(self, state, hook)  # DDP's own checks and errors, unchanged
        self._check_comm_hook(hook)
        slot.update(state=state, hook=hook, user=True)
        self.logger._set_comm_hook_name(hook.__qualname__)
        self._comm_hooks[-1] = (hook, state)

    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        slot = getattr(self, _SLOT, None)
        hook = _builtin(comm_hook_type)
        if slot is None or slot["user"] or hook is None:
            return builtin(self, comm_hook_type)
        slot.update(state=self.process_group, hook=hook, user=True)

    replacements: tuple[tuple[str, Any, Any], ...] = (
        ("__init__", __init__, init),
        ("register_comm_hook", register_comm_hook, register),
        ("_register_builtin_comm_hook", _register_builtin_comm_hook, builtin),
    )
    for name, fn, original in replacements:
        fn.__rankscope_original__ = original
        fn.__doc__, fn.__wrapped__ = original.__doc__, original
        setattr(DDP, name, fn)
    return True


def unpatch() -> None:
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP
    except Exception:
        return
    for name in ("__init__", "register_comm_hook", "_register_builtin_comm_hook"):
        original = getattr(getattr(DDP, name), "__rankscope_original__", None)
        if original is not None:
            setattr(DDP, name, original)


def _install(model: Any, register: Any, tracker: CollectiveTracker) -> None:
    pg = model.process_group
    timed = functools.partial(_allreduce, tracker, group_name(pg))  # the name once, not per bucket
    slot: dict[str, Any] = {"state": pg, "hook": timed, "user": False}

    # No annotations: DDP checks them against its own types, and this module's are strings.
    def rankscope_comm_hook(state, bucket):  # type: ignore[no-untyped-def]
        return slot["hook"](slot["state"], bucket)

    register(model, None, rankscope_comm_hook)
    setattr(model, _SLOT, slot)


def _allreduce(tracker: CollectiveTracker, group: str, pg: Any, bucket: Any) -> Any:
    """``allreduce_hook``'s average, timed: divide, then sum over the ranks."""
    tensor = bucket.buffer()
    tensor.div_(pg.size())
    call = tracker.enter(group, "all_reduce", tensor.element_size() * tensor.numel(), blocking=False)
    # One Python callback, not two: it completes the call and unwraps the result (half the GIL
    # hand-offs on the thread that completes the work).
    return pg.allreduce([tensor]).get_future().then(functools.partial(_completed, tracker, call))


def _completed(tracker: CollectiveTracker, call: Any, fut: Any) -> Any:
    result = fut.value()[0]  # raises the collective's error into DDP, as allreduce_hook does
    with contextlib.suppress(Exception):  # tracking must never fail the gradient sync
        tracker.exit(call)
    return result


def _builtin(comm_hook_type: Any) -> Any:
    """The Python equivalent of a built-in (C++) communication hook, or None."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {
        dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
        dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
    }.get(comm_hook_type)
