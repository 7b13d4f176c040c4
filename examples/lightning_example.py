"""rankmem in a Lightning Trainer: a tiny regression model on CPU, logged to a CSVLogger.

Run:  python -m torch.distributed.run --nproc-per-node 2 examples/lightning_example.py --out runs/pl
(or plain ``python examples/lightning_example.py`` for one process). ``<out>/.../metrics.csv`` has
``mem/host/peak_rss_gib/max``, ``.../max_rank``, ... every ``log_every_n_steps`` batches.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from rankmem.integrations.lightning import RankmemCallback


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


parser = argparse.ArgumentParser()
parser.add_argument("--out", default="runs/pl")
parser.add_argument("--devices", type=int, default=1)
args = parser.parse_args()

torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
trainer = L.Trainer(
    accelerator="cpu", devices=args.devices, num_nodes=1, max_steps=8, log_every_n_steps=2,
    strategy=L.pytorch.strategies.DDPStrategy(process_group_backend="gloo") if args.devices > 1 else "auto",
    logger=CSVLogger(args.out, name="csv"), callbacks=[RankmemCallback()],
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(Regressor(), DataLoader(data, batch_size=16))
if trainer.is_global_zero:
    print(f"metrics: {trainer.logger.log_dir}/metrics.csv")
