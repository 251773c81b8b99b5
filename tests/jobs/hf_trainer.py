"""A user's Hugging Face Trainer script, run by torchrun on 2 CPU processes (gloo), saving a
checkpoint every 800 steps, with rankscope as a callback. The Trainer builds DDP with
``find_unused_parameters=True`` for a model that is not a ``PreTrainedModel``.

    torchrun --nproc-per-node 2 tests/jobs/hf_trainer.py SPOOL_DIR OUT_DIR [WINDOW_S]
                                                         [--max-steps N] [--job ID] [--window-budget F]

WINDOW_S: the hook's ``window_s`` (without it, the hook's default: 30 s, longer than the test's
job). At the end rank 0 prints ``train: <steps> steps in <s> s (<ms> ms/step)`` from the
``Trainer``'s own ``train_runtime``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from rankscope.profiler_hook.hf import RankscopeCallback


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.net(x), labels)}


class Samples(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 64, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.x[i].sum(dim=0, keepdim=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spool")
    ap.add_argument("out")
    ap.add_argument("window_s", type=float, nargs="?")
    ap.add_argument("--max-steps", type=int, default=2400)
    ap.add_argument("--job", default="hf-job")
    ap.add_argument("--window-budget", type=float, help="the hook's window_budget (default: its own)")
    cli = ap.parse_args()
    hook: dict[str, Any] = {} if cli.window_s is None else {"window_s": cli.window_s}
    if cli.window_budget is not None:
        hook["window_budget"] = cli.window_budget
    args = TrainingArguments(
        output_dir=cli.out,
        max_steps=cli.max_steps,
        per_device_train_batch_size=32,
        save_steps=800,
        logging_steps=10,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=Regressor(),
        args=args,
        train_dataset=Samples(4096),
        callbacks=[RankscopeCallback(job=cli.job, spool_dir=cli.spool, **hook)],
    )
    result = trainer.train()
    if trainer.is_world_process_zero():
        took, steps = result.metrics["train_runtime"], result.global_step
        print(f"train: {steps} steps in {took:.2f} s ({1e3 * took / max(steps, 1):.2f} ms/step)", flush=True)


if __name__ == "__main__":
    main()
