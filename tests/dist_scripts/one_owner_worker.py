"""Run under torchrun by tests/fit/test_capacity.py (2 ranks): each step's phase ``update`` allocates and
touches 64 KiB per token of its micro-batch (real memory) and tells the monitor the tokens; at the end
rank 0 writes what the online advice watch concluded to OUT/online.json.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_scripts/one_owner_worker.py OUT
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import numpy as np
import torch.distributed as dist

import rankmem

PER_TOKEN = 64 * 1024
STEPS = 20  # the online watch judges every 10 collects: its last judgement sees every step


def tokens(rank: int, step: int) -> int:
    return 400 + 60 * ((step * 7 + rank * 3) % 20)


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    monitor = rankmem.Monitor(out_dir=out, device="cpu", children=False, near_oom_watch=False)
    for step in range(STEPS):
        with monitor.step(step), monitor.phase("update"):
            work = np.empty(tokens(rank, step) * PER_TOKEN // 8)
            work.fill(1.0)  # resident, not just reserved
            monitor.micro_batch(tokens(rank, step))
            del work
        monitor.collect()
    monitor.close()
    if rank == 0:
        with open(os.path.join(out, "online.json"), "w") as f:
            json.dump(monitor._publisher._advice_watch.assessment.to_json(), f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
