"""Run under torchrun by tests/offline/test_phase_rise.py: two gloo ranks, three phases per step.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_scripts/phase_rise_worker.py OUT MODE

MODE ``held``: every rank allocates and touches 256 MiB of host memory (and 1 GiB on a faked GPU) before
the first step and keeps it; the phases do nothing that moves memory, so every phase holds the step peak
and none raised it. MODE ``update``: rank 1's ``update`` phase allocates, touches and frees 256 MiB of
host memory (and 512 MiB on the faked GPU) every step; rank 0 does nothing.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

import rankmem
from rankmem.testing import FakeCuda

MIB = 1 << 20
STEPS = 6


def main(out: str, mode: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    cuda = FakeCuda(total=16 << 30)
    cuda.set_device(0)
    monitor = rankmem.Monitor(out_dir=out, device_module=cuda, children=False, near_oom_watch=False)
    held = [torch.ones(256 * MIB // 4), cuda.malloc(1 << 30)] if mode == "held" else []
    for step in range(STEPS):
        with monitor.step(step):
            for phase in ("rollout", "log_prob", "update"):
                with monitor.phase(phase):
                    if mode == "update" and phase == "update" and rank == 1:
                        spike, block = torch.ones(256 * MIB // 4), cuda.malloc(512 * MIB)
                        cuda.free(block)
                        del spike
        monitor.collect({"step": float(step)})
    monitor.close()
    del held
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
