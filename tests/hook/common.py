"""What the hook's tests share: trivial steps, a slow transport, a real c10d store, a hook
inside a window."""

from __future__ import annotations

import time
from typing import Any

import torch

from rankscope.profiler_hook import threadstates
from rankscope.profiler_hook.config import Config, Identity
from rankscope.profiler_hook.hook import Hook
from rankscope.profiler_hook.sinks import Sink
from tests.records import ListSink


class SlowSink:
    def __init__(self) -> None:
        self.got: list[bytes] = []

    def send(self, key: bytes, value: bytes) -> None:
        time.sleep(0.2)
        self.got.append(value)

    def close(self) -> None:
        pass


def run_steps(hook: Hook, n: int) -> float:
    """Run n trivial steps; the longest step in seconds."""
    worst = 0.0
    for _ in range(n):
        t = time.perf_counter()
        with hook.step():
            pass
        worst = max(worst, time.perf_counter() - t)
    return worst


def tcp_store() -> torch.distributed.TCPStore:
    """A real c10d store, as ``init_process_group`` makes one for every job."""
    return torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def one_rank_hook(sink: Sink, **config: Any) -> Hook:
    """A hook of a one-rank job on host "h" with ``Config(**config)``, shipping to ``sink``."""
    return Hook(Config(**config), Identity(rank=0, local_rank=0, world_size=1, host="h"), sink)


def in_a_window(sink: ListSink, steps: int) -> Hook:
    """A hook whose planned window opened at its second step, ``steps`` steps in."""
    hook = one_rank_hook(sink, heartbeat_s=60)
    hook.schedule.planned = 1
    for _ in range(steps):
        with hook.step():
            pass
    assert hook.window is not None, "the planned window is open"
    return hook


STASHES = threadstates.install()
