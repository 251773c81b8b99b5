"""PyTorch Lightning: the hook as a ``Callback``, with no change to the training loop::

    from rankscope.profiler_hook.lightning import RankscopeCallback
    trainer = Trainer(strategy="ddp", callbacks=[RankscopeCallback(job="llama-run-7")])

It attaches when fitting starts (before Lightning wraps the model in DDP, so its all-reduces are
timed), marks every training batch as a step numbered by ``trainer.global_step`` (so a run resumed
from a checkpoint numbers on), counts the time from one batch's end to the next one's start as the
step's data wait (validation and checkpoint saves in between excepted), times
``trainer.save_checkpoint`` as checkpoints, and closes when fitting ends or fails. Settings are
:class:`profiler_hook.Config` fields. Needs ``lightning`` (or ``pytorch_lightning``) ≥ 2.0:
``pip install rankscope[lightning]``.
"""

from __future__ import annotations

import functools
import time
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone package
    from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef,assignment]

from . import attach
from .hook import Hook


class RankscopeCallback(Callback):  # type: ignore[misc]
    def __init__(self, **settings: Any) -> None:
        self.settings = settings
        self.hook: Hook | None = None
        self._fetched_from: float | None = None
        """When the loop began fetching the next batch (None: not a plain fetch since)."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.hook is not None:
            return
        self.hook = attach(rank=trainer.global_rank, world_size=trainer.world_size, **self.settings)
        save = trainer.save_checkpoint

        @functools.wraps(save)
        def timed_save(*args: Any, **kwargs: Any) -> Any:
            started = time.time()
            try:
                return save(*args, **kwargs)
            finally:
                if self.hook is not None:
                    self.hook.record_checkpoint(started)
                self._fetched_from = time.perf_counter()

        trainer.save_checkpoint = timed_save

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.hook is None:
            return
        self.hook.begin_step(trainer.global_step if trainer.accumulate_grad_batches == 1 else None)
        if self._fetched_from is not None:
            self.hook.add_data_wait(time.perf_counter() - self._fetched_from)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.hook is not None:
            self.hook.end_step()
            self._fetched_from = time.perf_counter()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._fetched_from = None

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._fetched_from = time.perf_counter()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.hook is not None:
            self.hook.close()
            self.hook = None
