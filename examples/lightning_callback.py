"""Lightning: add `GradtrackCallback` to the Trainer; it writes to the trainer's own logger.

python examples/lightning_callback.py                 # console
python examples/lightning_callback.py --logger mlflow # the MLFlowLogger's run (./mlflow.db)
"""

from __future__ import annotations

import argparse

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import MLFlowLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradtrack.integrations.lightning import GradtrackCallback


class Regressor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1)
        )  # fmt: skip

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--logger", choices=["none", "mlflow"], default="none")
    args = parser.parse_args()

    torch.manual_seed(0)
    x = torch.randn(4096, 16)
    data = DataLoader(TensorDataset(x, x.pow(2).sum(dim=1, keepdim=True)), batch_size=32)
    logger = MLFlowLogger(tracking_uri="sqlite:///mlflow.db") if args.logger == "mlflow" else False
    trainer = Trainer(
        max_steps=args.steps, accelerator="cpu", logger=logger, log_every_n_steps=10,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[GradtrackCallback(log_every=10, console={"interval_s": 0})],
    )  # fmt: skip
    trainer.fit(Regressor(), data)


if __name__ == "__main__":
    main()
