"""Run under torchrun with ``--max-restarts 1`` by tests/faults/test_restart_faults.py (2 ranks): the first
attempt logs 3 steps, records an OOM on rank 1 and fails; the second (the restart) runs clean.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
        python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 tests/dist_scripts/restart_worker.py OUT
"""

from __future__ import annotations

import datetime
import os
import sys

import torch.distributed as dist

import rankmem


def main() -> int:
    out = sys.argv[1]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    monitor = rankmem.Monitor(out_dir=out, device="cpu", children=False, leak_check=False, near_oom_watch=False)
    for step in range(3 + attempt):
        with monitor.step(step):
            pass
        monitor.collect({"loss": float(step)})
    if attempt == 0:
        if dist.get_rank() == 1:
            monitor.record_oom(MemoryError("injected in the first attempt"))
        monitor.flush(30)
        dist.barrier()
        return 3  # a failed attempt: torchrun restarts every rank
    monitor.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
