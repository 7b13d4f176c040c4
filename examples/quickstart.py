"""A short distributed job that allocates, logs and prints rankmem's aggregated metrics.

Run:  python -m torch.distributed.run --nproc-per-node 2 examples/quickstart.py --out runs/quickstart

Rank r holds (r + 1) * 64 MiB of live host tensors and spikes by another 128 MiB inside a phase, so
the printed max_rank is the last rank and the phase peak sits 128 MiB above the step's current RSS.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist

import rankmem

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/quickstart")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    monitor = rankmem.Monitor(out_dir=args.out, sinks=("jsonl", "console"))
    held = []
    for step in range(args.steps):
        with monitor.step(step):
            held.append(torch.ones((rank + 1) * 64 * MIB // 4 // args.steps))
            with monitor.phase("spike"):
                spike = torch.ones(128 * MIB // 4)
                del spike
        metrics = monitor.collect({"held_mib": sum(t.numel() * 4 for t in held) / MIB})
    monitor.close()  # first: the console sink writes on its own thread, and its lines come before ours
    if rank == 0:
        for key in ("mem/host/rss_gib", "mem/phase/spike/peak_rss_gib", "held_mib"):
            print(f"{key}: max={metrics[key + '/max']:.3f} (rank {int(metrics[key + '/max_rank'])}) "
                  f"min={metrics[key + '/min']:.3f} mean={metrics[key + '/mean']:.3f}")
        print(f"run log: {args.out}/rankmem.jsonl")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
