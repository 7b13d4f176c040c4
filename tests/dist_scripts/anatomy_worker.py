"""Run under torchrun by tests/test_anatomy.py (2-4 ranks): the peak anatomy on the mirrored device
(tests/anatomy_helpers.py) against the truth each rank records, for a plain loop or the reference worker.
The last rank gets twice the tokens. Each rank writes OUT/rank<r>.json.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_scripts/anatomy_worker.py loop OUT
"""

from __future__ import annotations

import datetime
import json
import sys
from typing import Any

import torch
import torch.distributed as dist

import rankmem
from rankmem.core.units import GIB
from rankmem.engine.data import ArithmeticSFT
from rankmem.engine.model import GPT, GPTConfig
from rankmem.engine.worker import TrainingWorker, WorkerConfig
from tests.anatomy_helpers import Mirror, TensorCuda

STEPS = 3


def main(mode: str, out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    heavy = 2 if rank == world - 1 else 1
    torch.manual_seed(0)
    cuda = TensorCuda()
    monitor = rankmem.Monitor(device="cuda", device_module=cuda, children=False, near_oom_watch=False,
                              nvml_refresh_s=None)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_embd=64))
    params = list(model.parameters())
    mirror = Mirror(cuda, params)
    mirror.adopt(params)
    data = ArithmeticSFT(64, 32, 8 * heavy)
    if mode == "worker":
        worker = TrainingWorker(model, WorkerConfig(micro_batch_size=4 * heavy), device=torch.device("cpu"),
                                monitor=monitor)  # it calls monitor.track itself
        optimizer = worker.optimizer
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        monitor.track(model, optimizer)
    mirror.optimizer = optimizer
    records: list[dict[str, Any]] = []
    with mirror:
        for step in range(STEPS):
            truth: dict[str, tuple[int, int, int]] = {}
            batch = data.batch(rank, step)
            with monitor.step(step):
                for phase in ("update", "log_prob"):
                    mirror.mark()
                    # The worker's own phase: it tells its micro-batches inside its phases only.
                    with (worker.phase if mode == "worker" else monitor.phase)(phase):
                        if mode == "worker" and phase == "update":
                            worker.train_batch(batch)
                        elif mode == "worker":
                            worker.infer_batch(batch)
                        elif phase == "update":
                            for half in batch["input_ids"].chunk(2):  # two micro-batches of accumulation
                                monitor.micro_batch(half.numel())
                                model(half).float().logsumexp(-1).sum().backward()
                            optimizer.step()
                            optimizer.zero_grad(set_to_none=True)
                        else:
                            with torch.no_grad():
                                monitor.micro_batch(batch["input_ids"].numel())
                                model(batch["input_ids"]).sum()
                    truth[phase] = (mirror.peak, *mirror.truth)
            metrics = monitor.collect()
            record = monitor.last_record
            assert record is not None
            mine = {k: v[rank] for k, v in record.columns().items() if k.startswith("mem/phase/")}
            aggregates = {k: v for k, v in metrics.items() if "/anatomy/" in k}
            records.append({"truth": truth, "mine": mine, "aggregates": aggregates})
    params_direct = sum(p.untyped_storage().nbytes() for p in params) / GIB
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"params": params_direct, "heavy": heavy, "steps": records}, f)
    monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
