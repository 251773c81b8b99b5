"""Hugging Face ``Trainer``: the hook as a ``TrainerCallback``, with no change to the training loop::

    from rankscope.profiler_hook.hf import RankscopeCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[RankscopeCallback(job="run-7")])

It attaches when the ``Trainer`` is built (before it wraps the model in DDP, so its all-reduces are
timed), marks every optimizer step as a step numbered by ``state.global_step`` (a run resumed from
a checkpoint numbers on), counts the time from one step's end to the next one's start as the
step's data wait (logging, evaluation and saves in between excepted), records each checkpoint save
from the end of what came before it to ``on_save``, and closes when training ends. Settings are
:class:`profiler_hook.Config` fields. Needs ``transformers`` (and ``accelerate``, which its
``Trainer`` needs): ``pip install rankscope[hf]``.
"""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback

from . import attach
from .hook import Hook


class RankscopeCallback(TrainerCallback):  # type: ignore[misc]
    def __init__(self, **settings: Any) -> None:
        self.settings = settings
        self.hook: Hook | None = None
        self._fetched_from: float | None = None
        """When the loop began fetching the next step's batch (None: not a plain fetch since)."""
        self._since = time.time()
        """When the last thing before a save (a step, a log, an evaluation) ended."""

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.hook is None:
            self.hook = attach(rank=args.process_index, world_size=args.world_size, **self.settings)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.hook is None:
            return
        self.hook.begin_step(state.global_step)
        if self._fetched_from is not None:
            self.hook.add_data_wait(time.perf_counter() - self._fetched_from)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.hook is not None:
            self.hook.end_step()
        self._ended()

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._ended()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._ended()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.hook is not None:
            self.hook.record_checkpoint(self._since, state.global_step)
        self._ended()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.hook is not None:
            self.hook.close()
            self.hook = None

    def _ended(self) -> None:
        self._fetched_from, self._since = time.perf_counter(), time.time()
