"""Run under torchrun by tests/test_work.py (2-4 ranks): each rank tells its phases about micro-batches
whose token counts depend on its rank, and writes the run log.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_scripts/work_worker.py OUT
"""

from __future__ import annotations

import datetime
import sys

import torch.distributed as dist

import rankmem


def lengths(rank: int, step: int) -> list[list[int]]:
    """Micro-batches of sequence lengths: the second is the heaviest by tokens, and grows with rank and
    step; the first, lighter, has the largest sum of squared lengths (one long sequence)."""
    return [[60], [30 + rank, 40 + step, 5], [7]]


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    monitor = rankmem.Monitor(out_dir=out, device="cpu", children=False, near_oom_watch=False)
    for step in range(3):
        with monitor.step(step):
            with monitor.phase("update"):
                for mb in lengths(rank, step):
                    monitor.micro_batch(sum(mb), sequences=len(mb), sq_tokens=sum(s * s for s in mb))
            with monitor.phase("log_prob"):
                monitor.micro_batch(100 * (rank + 1))  # tokens only
        monitor.collect({"loss": 1.0})
    monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
