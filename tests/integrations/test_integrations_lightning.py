"""Lightning integration, with a real Lightning Trainer on CPU, read back from a CSVLogger's metrics.csv."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

REPO = Path(__file__).resolve().parents[2]
KEYS = ("mem/host/rss_gib", "mem/host/peak_rss_gib", "mem/phase/train_step/peak_rss_gib")


def _rows(path: Path) -> list[dict[str, float]]:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return [{k: float(v) for k, v in r.items() if v != ""} for r in rows if r.get("mem/host/rss_gib/max")]


def _check_row(row: dict[str, float], world: int) -> None:
    for key in KEYS:
        lo, mean, hi = row[key + "/min"], row[key + "/mean"], row[key + "/max"]
        assert 0.05 < lo <= mean <= hi < 8, (key, lo, mean, hi)
        assert row[key + "/max_rank"] in range(world)
    assert row["mem/host/peak_rss_gib/max"] >= row["mem/host/rss_gib/max"]


def test_lightning_single_process(tmp_path: Path) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from rankmem.integrations.lightning import RankmemCallback

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.lin(batch[0]).pow(2).mean()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = RankmemCallback(every_n_steps=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[cb], log_every_n_steps=1,
                        logger=CSVLogger(str(tmp_path), name="csv"),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(12, 4)), batch_size=4))
    with open("/proc/self/statm") as f:
        statm = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    # The last window ended moments ago: its RSS is this process's RSS now, within 64 MiB.
    assert abs(cb.last_metrics["mem/host/rss_gib/max"] - statm) < 1 / 16
    rows = _rows(tmp_path / "csv/version_0/metrics.csv")
    # On the steps Lightning logs the loss at (its logger's step, not global_step, one ahead).
    with open(tmp_path / "csv/version_0/metrics.csv") as f:
        loss_steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("loss")]
    assert [r["step"] for r in rows] == loss_steps == [0, 1, 2]
    with open(tmp_path / "csv/version_0/metrics.csv") as f:  # on the loss's own rows: one row per step
        assert [(bool(r["loss"]), bool(r["mem/host/rss_gib/max"])) for r in csv.DictReader(f)] == [(True, True)] * 3
    for row in rows:
        _check_row(row, world=1)
        assert row["mem/host/rss_gib/max_rank"] == 0
    with pytest.raises(ValueError, match="every_n_steps must be >= 1"):
        RankmemCallback(every_n_steps=0)


def test_log_keys_choose_what_reaches_the_loggers(tmp_path: Path) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from rankmem.integrations.lightning import RankmemCallback

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = RankmemCallback(every_n_steps=1, log_keys=["mem/host/peak_rss_gib/max*"])
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, callbacks=[cb], log_every_n_steps=1,
                        logger=CSVLogger(str(tmp_path), name="csv"), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
    with open(tmp_path / "csv/version_0/metrics.csv") as f:
        columns = next(csv.reader(f))
    assert sorted(c for c in columns if c.startswith("mem/")) == ["mem/host/peak_rss_gib/max",
                                                                   "mem/host/peak_rss_gib/max_rank"]
    assert "mem/host/rss_gib/max" in cb.last_metrics  # measured all the same


def test_lightning_oom_in_a_training_step_becomes_an_event(tmp_path: Path) -> None:
    import lightning as L
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from rankmem.integrations.lightning import RankmemCallback
    from rankmem.offline.events import read_events

    class RunsOutAtStep2(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            if batch_idx == 2:
                np.ones(1 << 62, dtype=np.uint8)  # a real MemoryError (4 EiB)
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    callback = RankmemCallback(out_dir=str(tmp_path), near_oom_watch=False, every_n_steps=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, callbacks=[callback],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(MemoryError):
        trainer.fit(RunsOutAtStep2(), DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4))
    (event,) = read_events(str(tmp_path)).events
    # The step is the one its collect would have logged: steps 0 and 1 were.
    assert (event.kind, event.where, event.step, event.phase) == ("oom", "host", 2, "train_step")


def test_a_lightning_job_with_the_callback_alone_gets_advice_in_its_batch_size(tmp_path: Path) -> None:
    """Two DDP ranks (torchrun, gloo) of a tiny Llama on padded mapping batches, 2 batches accumulated
    per optimizer step: one collect per step, each batch told as a micro-batch from its shape, and
    ``rankmem advise`` sizes the DataLoader's batch_size."""
    import json
    import subprocess
    import sys

    from rankmem.core.catalogue import work_key
    from rankmem.offline import read_run
    from tests.conftest import torchrun

    pytest.importorskip("transformers")
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "4096",
           "MALLOC_TRIM_THRESHOLD_": "131072"}  # docs/advice.md: each window's host peak its own
    proc = torchrun(REPO / "tests/dist_scripts/lightning_llama_worker.py", 2,
                    [str(out), "--steps", "24", "--accum", "2"], timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = read_run(str(out))
    assert run.steps.tolist() == list(range(24))
    assert (run.series[work_key("train_step", "micro_batches")] == 2).all()
    tokens = run.series[work_key("train_step", "mb_tokens")]
    width = run.series[work_key("train_step", "mb_sq_tokens")] / tokens
    # 4 rows, each padded to the batch's longest (16..128 tokens)
    assert ((tokens % 4 == 0) & (width == tokens / 4) & (width >= 16) & (width <= 128)).all()
    done = subprocess.run([sys.executable, "-m", "rankmem", "advise", str(out), "--json"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr
    binding = next(r for r in json.loads(done.stdout) if r["binding"])
    longest = round(float(width[2:].max()))  # after advise's 2 warm-up steps
    assert binding["setting"] == {"DataLoader.batch_size": binding["max_tokens"] // longest}


def test_tokens_from_tells_the_work_of_a_batch_that_is_no_mapping(tmp_path: Path) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from rankmem.core.catalogue import work_key
    from rankmem.integrations.lightning import RankmemCallback
    from rankmem.offline import read_run

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    # Rows of 10 tokens each: (tokens, sequences, squared lengths).
    cb = RankmemCallback(out_dir=str(tmp_path / "run"), sinks=("jsonl",), near_oom_watch=False,
                         tokens_from=lambda batch: (10 * len(batch[0]), len(batch[0]), 100 * len(batch[0])))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[cb], logger=False,
                        accumulate_grad_batches=2, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(30, 4)), batch_size=5))
    run = read_run(str(tmp_path / "run"))
    assert run.steps.tolist() == [0, 1, 2]  # one collect per optimizer step, 2 batches each
    assert run.series[work_key("train_step", "mb_tokens")][:, 0].tolist() == [50.0] * 3
    assert run.series[work_key("train_step", "tokens")][:, 0].tolist() == [100.0] * 3
    assert run.series[work_key("train_step", "mb_sq_tokens")][:, 0].tolist() == [500.0] * 3
    assert run.header.config["run"]["framework"] == {"name": "lightning"}
