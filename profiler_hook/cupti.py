"""CUPTI, which torch.profiler's CUDA activity runs on: started once at attach, detached between windows.

- The first profiler session with CUDA activity in a process starts CUPTI, which takes seconds:
  :func:`start` pays that at attach, so that no training step does.
- After a session kineto leaves CUPTI attached unless ``TEARDOWN_CUPTI=1`` is in the environment,
  and every kernel launch then pays CUPTI's callbacks for the rest of the run (a launch-bound loop
  slows by tens of percent; docs/hook.md has the measurements). So :func:`ask_teardown` asks for the
  teardown where torch itself deems it safe beside CUDA graphs: CUDA 12.6 or later, with lazy
  re-initialization allowed (torch's profiler and ``torch.compile`` turn it off where graphs would
  crash on it). A window's start then re-attaches CUPTI, which the window budget counts. A user's
  own ``TEARDOWN_CUPTI`` stands.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Iterator

log = logging.getLogger(__name__)

TEARDOWN = "TEARDOWN_CUPTI"
MIN_CUDA = (12, 6)
"""The CUDA release from which torch re-initializes CUPTI lazily beside CUDA graphs after a teardown."""


def ask_teardown() -> bool:
    """Set ``TEARDOWN_CUPTI=1`` where it is safe and unset, and say in the log what CUPTI does between
    windows; whether it is detached."""
    if TEARDOWN in os.environ:
        log.info("rankscope: CUPTI between windows: as %s=%s says", TEARDOWN, os.environ[TEARDOWN])
        return os.environ[TEARDOWN] == "1"
    import torch

    try:
        cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
        from torch._utils_internal import profiler_allow_cudagraph_cupti_lazy_reinit_cuda12

        lazy = bool(profiler_allow_cudagraph_cupti_lazy_reinit_cuda12())
    except Exception:  # a torch without the check: keep kineto's default
        cuda, lazy = (0, 0), False
    if cuda < MIN_CUDA or not lazy:
        log.warning(
            "rankscope: CUDA %s: CUPTI stays attached after the first window (detaching it is unsafe "
            "beside CUDA graphs before CUDA 12.6), which slows kernel launches; %s=1 detaches it",
            torch.version.cuda,
            TEARDOWN,
        )
        return False
    os.environ[TEARDOWN] = "1"
    return True


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Some releases (2.10, 2.11) warn at every profiler's first start that events are cleared at the
    end of each cycle, for sessions that have one cycle (pytorch/pytorch#180387): a line in the
    user's log that is not theirs. Their remedy, ``acc_events``, turns every event into a Python
    object at ``stop()``: 0.5-1 s on the training thread."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*clears events at the end of each cycle")
        yield


def start() -> None:
    """Start CUPTI, which a profiler session with CUDA activity does the first time in a process:
    seconds, where later sessions start in milliseconds. Here, at attach, no training step waits for it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with quiet(), profile(activities=[ProfilerActivity.CUDA]):
        torch.cuda.synchronize()
    log.info("rankscope: CUPTI started in %.1f s, at attach", time.perf_counter() - t0)
