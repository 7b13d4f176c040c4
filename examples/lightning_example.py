"""rankmem in a Lightning Trainer: a tiny regression model on CPU, logged to a CSVLogger.

Run:  python -m torch.distributed.run --nproc-per-node 2 examples/lightning_example.py --out runs/pl
(or plain ``python examples/lightning_example.py`` for one process). The Trainer takes its devices
from torchrun's environment, so both ranks join one DDP job. ``<out>/csv/version_0/metrics.csv`` has
``mem/host/peak_rss_gib/max``, ``.../max_rank``, ... on the same rows as ``loss``, and the run log
``<out>/rankmem.jsonl`` has every key per rank: ``rankmem report <out>``.
"""

from __future__ import annotations

import argparse
import os

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
args = parser.parse_args()

# Under torchrun, one process per rank already exists: tell the Trainer how many, or each process
# would start a 1-device trainer of its own.
devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
nodes = int(os.environ.get("WORLD_SIZE", str(devices))) // devices

torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
trainer = L.Trainer(
    accelerator="cpu", devices=devices, num_nodes=nodes, max_steps=8, log_every_n_steps=2,
    strategy=L.pytorch.strategies.DDPStrategy(process_group_backend="gloo") if devices * nodes > 1 else "auto",
    logger=CSVLogger(args.out, name="csv"),
    callbacks=[RankmemCallback(out_dir=args.out, sinks=("jsonl",))],  # the run log, for rankmem report
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(Regressor(), DataLoader(data, batch_size=16))
if trainer.is_global_zero:
    print(f"metrics: {trainer.logger.log_dir}/metrics.csv")
