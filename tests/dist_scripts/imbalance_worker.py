"""Run under torchrun by tests/offline/test_imbalance.py (4 ranks): each step's phase allocates and touches
64 KiB per token of its micro-batch (real memory), and tells the monitor the tokens.

    python -m torch.distributed.run --nproc-per-node 4 tests/dist_scripts/imbalance_worker.py OUT MODE=SEEDS...

MODE: ``tokens`` (rank 2 gets twice the tokens), ``buffer`` (rank 1 holds a hidden 200 MiB buffer),
``balanced`` (every rank the same distribution); SEEDS: comma-separated. One run directory per mode and
seed, OUT/<mode>/<seed>. Every mode in one launch: starting 4 ranks costs more than a run of 10 steps.
"""

from __future__ import annotations

import datetime
import os
import sys

import numpy as np
import torch.distributed as dist

import rankmem

PER_TOKEN = 64 * 1024
STEPS = 10
TOKENS_RANK, BUFFER_RANK, BUFFER = 2, 1, 200 * 2**20


def touched(nbytes: int) -> np.ndarray:
    a = np.empty(nbytes // 8)
    a.fill(1.0)  # resident, not just reserved
    return a


def one_run(out: str, mode: str, seed: int, rank: int) -> None:
    monitor = rankmem.Monitor(out_dir=os.path.join(out, mode, str(seed)), device="cpu", children=False,
                              near_oom_watch=False, leak_check=False)
    common = np.random.default_rng(seed)
    own = np.random.default_rng(seed * 100 + rank)
    for step in range(STEPS):
        base = common.integers(400, 1600)
        tokens = int(base * own.uniform(0.9, 1.1) * (2 if mode == "tokens" and rank == TOKENS_RANK else 1))
        with monitor.step(step), monitor.phase("update"):
            work = touched(tokens * PER_TOKEN)
            monitor.micro_batch(tokens)
            del work
        monitor.collect()
    monitor.close()


def main(out: str, *specs: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    for spec in specs:
        mode, _, seeds = spec.partition("=")
        hidden = touched(BUFFER) if mode == "buffer" and rank == BUFFER_RANK else None
        for seed in map(int, seeds.split(",")):
            one_run(out, mode, seed, rank)
        del hidden
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
