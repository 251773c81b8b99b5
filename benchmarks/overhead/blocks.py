"""Run a user's training script with the hook alternately working and paused, in blocks of steps.

    torchrun ... -m benchmarks.overhead.blocks SCRIPT [SCRIPT'S ARGS ...]

``benchmarks.overhead.job --in-run`` launches each job so: the script runs unchanged, as its user
runs it, and its hook (``profiler_hook.attach`` or a framework's callback) is switched by
:class:`Blocks`, which runs after each :meth:`Hook.end_step`. After ``$AB_START_STEPS`` steps of
warm-up the ranks agree on the steps per block (``$AB_BLOCK_S`` seconds of the slowest rank's
steps), then alternate working and paused blocks in pairs whose order alternates, as
``benchmarks.overhead.hook`` does on its MLP: a working block goes on while a window is busy on
any rank, so that no window is cut short or summarized in a paused block. The agreement and those
checks are one small all-reduce on the default group, between blocks and outside their time.
At ``hook.close()`` each rank writes its blocks to ``$AB_OUT/rank<r>.json``. ``$AB_HOOK`` (a JSON
object of ``Config`` fields) sets hook options the script's ``attach`` does not, to find where a
cost is; the figures to report are those at the defaults.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

from rankscope.profiler_hook.hook import Hook

WARM_TAIL = 20
"""The last warm-up steps whose time sets the blocks' length."""
SETTLING = 1
"""Steps after each switch that no block times: they carry the switch itself (``resume`` patches
the collectives, ``pause`` puts them back, on every rank at the same step, so a pipeline's ranks
wait for each other's), which a hook that is never paused does not pay (what it cost the
pipeline job's working blocks: docs/benchmarks.md)."""


def _clocks() -> tuple[float, float, float]:
    """Now, the process's CPU time and the calling thread's (the training thread's: blocks are
    switched after its steps), seconds."""
    return time.perf_counter(), time.process_time(), time.thread_time()


def window_busy(hook: Hook) -> bool:
    """Whether a window of ``hook`` is profiling or being summarized (a pause would cut it short,
    or leave its summarizing to the paused block)."""
    return hook._prof is not None or any(t.is_alive() for t in hook._summarizers)


class Blocks:
    def __init__(self, hook: Hook, out: Path, start_steps: int, block_s: float) -> None:
        if start_steps <= WARM_TAIL:  # the blocks' length comes from the last WARM_TAIL of them
            raise ValueError(
                f"$AB_START_STEPS must be more than {WARM_TAIL} steps of warm-up, got {start_steps}"
            )
        self.hook, self.out = hook, out
        self.start_steps, self.block_s = start_steps, block_s
        self.steps = 0
        self.n = 0
        """Steps per block, once agreed."""
        self.mode, self.in_block, self.length = "on", 0, 0
        self.took = [0.0, 0.0, 0.0]
        """The block's timed steps so far: seconds, the process's CPU seconds, the training thread's."""
        self.settling = 0
        """Steps of the block still to come before it is timed (``SETTLING``)."""
        self.mark = _clocks()
        self.blocks: list[tuple[str, float, int, float, float]] = []
        """(mode, seconds, steps, the process's CPU seconds, the training thread's) per block."""

    def ended(self) -> None:
        """After each step, working or paused."""
        now = _clocks()
        self.steps += 1
        if not self.n:
            if self.steps == self.start_steps - WARM_TAIL:
                self.mark = now
            elif self.steps == self.start_steps:
                self.n = max(3, round(self.block_s * WARM_TAIL / self._most(now[0] - self.mark[0])))
                self._begin("on")
            return
        if self.settling:
            self.settling -= 1
            self.mark = now
            return
        self.in_block += 1
        if self.in_block < self.length:
            return
        self.took = [took + b - a for took, a, b in zip(self.took, self.mark, now, strict=True)]
        if self.mode == "on" and self._most(float(window_busy(self.hook))):
            self.length += self.n  # a window is busy on some rank: the working block goes on
            self.mark = _clocks()
            return
        seconds, cpu, thread = self.took
        self.blocks.append((self.mode, seconds, self.in_block, cpu, thread))
        pair, first = divmod(len(self.blocks), 2)
        order = ("on", "off") if pair % 2 == 0 else ("off", "on")
        self._begin(order[first])

    def _begin(self, mode: str) -> None:
        if mode == "on":
            self.hook.resume()
        else:
            self.hook.pause()
        self.mode, self.in_block, self.length, self.took = mode, 0, self.n, [0.0, 0.0, 0.0]
        self.settling = SETTLING
        self.mark = _clocks()

    @staticmethod
    def _most(value: float) -> float:
        """The largest ``value`` of any rank (every rank calls it at the same step)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def save(self) -> None:
        b = self.hook.budget
        record: dict[str, Any] = {
            "steps_per_block": self.n,
            "blocks": self.blocks,
            "windows": b.windows,
            "window_cost_us": b.spent_ns // 1000,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        Path(self.out, f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))


def install(out: Path, start_steps: int, block_s: float, options: dict[str, Any]) -> None:
    """Switch every hook of this process by blocks; ``options``: settings every ``attach`` gets."""
    import rankscope.profiler_hook as profiler_hook

    end_step, close, attach = Hook.end_step, Hook.close, profiler_hook.attach
    blocks: dict[int, Blocks] = {}

    def switched_end_step(self: Hook) -> None:
        end_step(self)
        if self.enabled:
            blocks.setdefault(id(self), Blocks(self, out, start_steps, block_s)).ended()

    def saving_close(self: Hook, timeout: float = 10.0) -> None:
        if id(self) in blocks:
            self.resume()  # the hook closes as it would have, working
            blocks.pop(id(self)).save()
        close(self, timeout)

    def attach_with(*args: Any, **settings: Any) -> Hook:
        return attach(*args, **{**settings, **options})

    profiler_hook.attach = attach_with  # type: ignore[assignment]
    Hook.end_step = switched_end_step  # type: ignore[method-assign]
    Hook.close = saving_close  # type: ignore[method-assign]


if __name__ == "__main__":
    install(
        Path(os.environ["AB_OUT"]),
        int(os.environ["AB_START_STEPS"]),
        float(os.environ["AB_BLOCK_S"]),
        json.loads(os.environ.get("AB_HOOK") or "{}"),
    )
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
