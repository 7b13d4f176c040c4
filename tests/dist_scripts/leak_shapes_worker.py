"""Run under torchrun by tests/trend/test_leak_jobs.py: 4 ranks, 160 steps of a small all_reduce each in
phase ``update``, and one shape of host memory per rank, in the bytes a process really holds (touched):

- rank 0: a one-off +150 MiB buffer at step 110, kept (a cache allocated once);
- rank 1: the leak, 2 MiB kept per step in ``update`` for 150 steps, then nothing more;
- rank 2: a warm-up, 10 MiB a step for the first 20 steps, then held;
- rank 3: a cache that fills 4 MiB a step for 25 steps and is freed (a sawtooth).

Every rank adds a step end's +-40 MiB spike on a third of its steps (held across the collect, let go at
the next step). python -m torch.distributed.run --nproc-per-node 4 leak_shapes_worker.py OUT
"""

from __future__ import annotations

import datetime
import random
import sys

import torch
import torch.distributed as dist

import rankmem

MIB = 1 << 20
STEPS = 160


def touched(mib: int) -> bytearray:
    return bytearray(b"\x01") * (mib * MIB)  # written, so it is resident


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    monitor = rankmem.Monitor(out_dir=out, device="cpu", near_oom_watch=False)
    rng = random.Random(rank)
    kept: list[bytearray] = []
    cache: list[bytearray] = []
    ballast = touched(40)  # the -40 MiB spikes let this go for a collect
    spike: list[bytearray] = []  # held across the collect, let go at the next step
    for step in range(STEPS):
        spike.clear()
        if ballast is None:
            ballast = touched(40)
        with monitor.step(step):
            with monitor.phase("update"):
                t = torch.ones(1024)
                dist.all_reduce(t)
                if rank == 1 and step < 150:
                    kept.append(touched(2))
            if rank == 0 and step == 110:
                kept.append(touched(150))
            if rank == 2 and step < 20:
                kept.append(touched(10))
            if rank == 3:
                cache = [] if step % 25 == 0 else [*cache, touched(4)]
            draw = rng.random()
            if draw < 1 / 6:
                spike.append(touched(40))
            elif draw < 1 / 3:
                ballast = None  # type: ignore[assignment]
        monitor.collect({"loss": 1.0})
    monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
