"""Run under torchrun by tests/test_worst_rank.py: three ranks on faked GPUs, rank 1 sharing its device
with a colocated 6 GiB engine; each rank writes its last collect to OUT/rank<r>.json.

    python -m torch.distributed.run --nproc-per-node 3 tests/dist_scripts/worst_rank_worker.py OUT
"""

from __future__ import annotations

import datetime
import json
import sys

import torch.distributed as dist

import rankmem
from rankmem.testing import FakeCuda

GIB, MIB = 1 << 30, 1 << 20


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    cuda = FakeCuda(total=16 * GIB, context=300 * MIB)
    if rank == 1:
        cuda.other_process = 6 * GIB  # a colocated inference engine: outside this process's allocator
    cuda.set_device(0)
    monitor = rankmem.Monitor(out_dir=out, sinks=("jsonl", "console"), device_module=cuda, children=False)
    held = cuda.malloc((rank + 1) * GIB)  # rank 2 holds the most, so the max and the min differ in rank
    metrics: dict[str, float] = {}
    for step in range(3):
        with monitor.step(step):
            cuda.free(cuda.malloc(512 * MIB))
        metrics = monitor.collect()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(metrics, f)
    cuda.free(held)
    monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
