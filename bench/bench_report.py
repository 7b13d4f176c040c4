"""``rankmem report`` on a large run log, timed against a plain ``json.loads`` of every line.

Run:  python bench/bench_report.py [--steps 100000] [--ranks 8]

Writes (once, cached under the temp dir) a run log through the real RunLogWriter with the keys of a
GPU run with two phases: 28 per-rank keys, 8 ranks, aggregated keys included, about 10 KiB a line.
Then times, in the same process: (a) ``for line in f: json.loads(line)``; (b) ``read_run``; (c) the
whole report (read, per-key peaks with phase attribution, growth, leak verdicts). Prints the ratios.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import tempfile
import time
from contextlib import redirect_stdout

import numpy as np

from rankmem._collective import aggregate
from rankmem._records import RankInfo, RunHeader, StepRecord
from rankmem.report import build_report, render
from rankmem.runlog import RunLogWriter, read_run

HOST = ("rss", "peak_rss", "lifetime_peak_rss", "children_rss")
NODE = ("used", "available")
DEVICE = ("allocated", "reserved", "peak_allocated", "peak_reserved", "lifetime_peak_reserved", "used", "total",
          "other", "headroom")
PHASE = ("peak_rss", "rss_delta", "peak_allocated", "peak_reserved", "allocated_delta")


def keys() -> list[str]:
    out = [f"mem/host/{k}_gib" for k in HOST] + [f"mem/node/{k}_gib" for k in NODE]
    out += [f"mem/device/{k}_gib" for k in DEVICE] + ["mem/device/alloc_retries", "mem/device/ooms"]
    out += [f"mem/phase/{p}/{k}_gib" for p in ("rollout", "update") for k in PHASE] + ["loss"]
    return sorted(out)


def generate(path: str, steps: int, world: int) -> None:
    rng = np.random.default_rng(0)
    ks = keys()
    ranks = [RankInfo(rank=r, local_rank=r % 8, host=f"node{r // 8}", pid=100 + r, device="cuda NVIDIA H100",
                      peak_rss_scope="window") for r in range(world)]
    writer = RunLogWriter(path)
    writer.open(RunHeader(world_size=world, ranks=ranks, config={}, started=1.7e9))
    level = rng.uniform(5, 60, (len(ks), world))
    for step in range(steps):
        matrix = level + rng.normal(0, 0.01, level.shape)  # keys x ranks, full-precision floats
        record = StepRecord(step=step, time=1.7e9 + step, metrics=aggregate(ks, matrix.T),
                            ranks={k: matrix[i].tolist() for i, k in enumerate(ks)})
        writer.write(record)
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    path = os.path.join(tempfile.gettempdir(), f"rankmem_bench_{args.steps}x{args.ranks}.jsonl")
    if not os.path.exists(path):
        t0 = time.perf_counter()
        generate(path + ".tmp", args.steps, args.ranks)
        os.replace(path + ".tmp", path)
        print(f"generated {path} in {time.perf_counter() - t0:.1f} s")
    size = os.path.getsize(path)
    print(f"run log: {args.steps} steps x {args.ranks} ranks, {len(keys())} per-rank keys, {size / 2**20:.0f} MiB")

    def plain() -> None:
        with open(path, encoding="utf-8") as f:
            for line in f:
                json.loads(line)

    def report() -> None:
        with redirect_stdout(io.StringIO()):
            render(build_report(read_run(path)))

    # The machine is shared: alternate the contenders and keep each one's best of --repeat runs, in wall
    # time and in this process's CPU time (less disturbed by other processes on the same cores).
    contenders = (("plain", plain), ("read", lambda: read_run(path)), ("report", report))
    wall = {name: math.inf for name, _ in contenders}
    cpu = dict(wall)
    for _ in range(args.repeat):
        for name, fn in contenders:
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name] = min(wall[name], time.perf_counter() - t0)
            cpu[name] = min(cpu[name], time.process_time() - c0)
    t0, c0 = time.perf_counter(), time.process_time()
    read_run(path, metrics=True)
    wall["full"], cpu["full"] = time.perf_counter() - t0, time.process_time() - c0

    print(f"{'':35s}  {'wall':>16s}  {'cpu':>16s}")
    for name, label in (("plain", "plain json.loads per line:"), ("read", "read_run (arrays, per-rank part):"),
                        ("report", "rankmem report (read + analyse):"), ("full", "read_run(metrics=True), one run:")):
        print(f"{label:35s}  {wall[name]:6.2f} s ({wall[name] / wall['plain']:.2f}x)"
              f"  {cpu[name]:6.2f} s ({cpu[name] / cpu['plain']:.2f}x)")
    if os.path.exists("/proc/loadavg"):
        with open("/proc/loadavg") as f:
            print("load average after the runs (1, 5, 15 min):", " ".join(f.read().split()[:3]))


if __name__ == "__main__":
    main()
