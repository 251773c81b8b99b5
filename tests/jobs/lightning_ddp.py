"""A user's PyTorch Lightning script: 2 CPU processes under Lightning's own DDP launcher, with a
ModelCheckpoint every 20 steps, validation every 25 and rankscope as a callback.

    python tests/jobs/lightning_ddp.py SPOOL_DIR CKPT_DIR
"""

from __future__ import annotations

import sys

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rankscope.profiler_hook.lightning import RankscopeCallback


class Regressor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    spool, ckpt = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    x = torch.randn(4096, 64)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=60,
        val_check_interval=25,
        limit_val_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=ckpt, every_n_train_steps=20, save_top_k=-1),
            RankscopeCallback(job="lightning-job", spool_dir=spool),
        ],
    )
    trainer.fit(Regressor(), DataLoader(data, batch_size=32), DataLoader(data, batch_size=32))


if __name__ == "__main__":
    main()
