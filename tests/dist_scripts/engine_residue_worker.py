"""Run under torchrun by tests/probe/test_engine_residue.py: two ranks, each on its own FakeCuda device with a
FakeNvml over it and a real child process standing in for a colocated engine. Each step runs ``update``
then ``sleep``; at the end of the sleep the engine holds HELD MiB, and on rank 1 GROWTH MiB more after
each sleep. Each rank writes what its engine held, step by step, to OUT/held<r>.json.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_scripts/engine_residue_worker.py OUT
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time

import torch.distributed as dist

import rankmem
from rankmem.testing import FakeCuda, FakeNvml

MIB = 2**20
STEPS = 40
HELD = 400
GROWTH = 8


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        cuda = FakeCuda(context=300 * MIB)
        nvml = FakeNvml(cuda)
        # A slow refresh: the residue comes from the split the end of each sleep asks for.
        monitor = rankmem.Monitor(device_module=cuda, nvml_module=nvml, out_dir=out, sinks=("jsonl",),
                                  nvml_refresh_s=30.0, leak_check=False, near_oom_watch=False)
        cuda.set_device(0)
        cuda.malloc(256 * MIB)
        held: dict[int, int] = {}
        for step in range(1, STEPS + 1):
            with monitor.step(step):
                with monitor.phase("update"):
                    nvml.add_process(engine.pid, 3000 * MIB)  # awake: weights and KV cache
                    time.sleep(0.005)
                with monitor.phase("sleep"):
                    held[step] = HELD + (GROWTH * step if rank == 1 else 0)
                    nvml.add_process(engine.pid, held[step] * MIB)
            monitor.collect()
        with open(os.path.join(out, f"held{rank}.json"), "w") as f:
            json.dump(held, f)
        dist.barrier()
        monitor.close()
    finally:
        engine.kill()
        engine.wait(10)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
