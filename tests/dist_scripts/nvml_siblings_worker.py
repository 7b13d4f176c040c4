"""Run under torchrun by tests/probe/test_nvml_siblings.py: two ranks, each on its own FakeCuda device
with a FakeNvml over it; rank 1 also holds 500 MiB on rank 0's device (a stray context, as when every
rank initialises cuda:0). Each rank writes its split to OUT/rank<r>.json.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_scripts/nvml_siblings_worker.py OUT
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch.distributed as dist

import rankmem
from rankmem.testing import FakeCuda, FakeNvml

MIB = 2**20


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    pids: list[int] = [0, 0]
    dist.all_gather_object(pids, os.getpid())
    cuda = FakeCuda(context=300 * MIB)
    nvml = FakeNvml(cuda)
    if rank == 0:
        nvml.add_process(pids[1], 500 * MIB)
    monitor = rankmem.Monitor(device_module=cuda, nvml_module=nvml, out_dir=out, sinks=(), nvml_refresh_s=0.02,
                              leak_check=False, near_oom_watch=False, children=False)
    cuda.set_device(0)
    cuda.malloc(256 * MIB * (rank + 1))
    record = None
    for step in range(300):
        with monitor.step(step):
            time.sleep(0.02)
        monitor.collect()
        record = monitor.last_record
        assert record is not None
        column = record.columns().get("mem/device/siblings_gib")
        if column is not None and all(v is not None for v in column):  # the same on every rank: gathered
            break
    split = monitor._attribution.fresh(2.0) if monitor._attribution is not None else None
    dist.barrier()  # both heartbeats alive until both have split
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"split": split.to_event() if split is not None else None,
                   "siblings": record.columns().get("mem/device/siblings_gib") if record else None}, f)
    monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
