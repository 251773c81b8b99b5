"""A user's Hugging Face Trainer script, run by torchrun on 2 CPU processes (gloo), saving a
checkpoint every 800 steps, with rankscope as a callback. The Trainer builds DDP with
``find_unused_parameters=True`` for a model that is not a ``PreTrainedModel``.

    torchrun --nproc-per-node 2 tests/jobs/hf_trainer.py SPOOL_DIR OUT_DIR [WINDOW_S]

WINDOW_S: the hook's ``window_s`` (its default, 30 s, is longer than this job).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from profiler_hook.hf import RankscopeCallback


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
    spool, out = sys.argv[1], sys.argv[2]
    args = TrainingArguments(
        output_dir=out,
        max_steps=2400,
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
        callbacks=[RankscopeCallback(job="hf-job", spool_dir=spool, window_s=float(sys.argv[3]))],
    )
    trainer.train()


if __name__ == "__main__":
    main()
