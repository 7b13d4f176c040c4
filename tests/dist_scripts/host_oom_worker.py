"""Run under torchrun by tests/test_forensics.py (2 ranks): rank 1 caps its address space and hits a
real MemoryError inside phase ``update`` at step 3.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_scripts/host_oom_worker.py OUT
"""

from __future__ import annotations

import datetime
import resource
import sys

import numpy as np
import torch.distributed as dist

import rankmem


def vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    monitor = rankmem.Monitor(out_dir=out, near_oom_watch=False)
    for step in range(6):
        with monitor.step(step):
            with monitor.phase("rollout"):
                pass
            with monitor.phase("update"):
                if rank == 1 and step == 3:
                    cap = vm_size() + 64 * 2**20
                    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
                    np.ones(512 * 2**20, dtype=np.uint8)  # beyond the cap: MemoryError
        monitor.collect({"step_done": float(step)})
    monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
