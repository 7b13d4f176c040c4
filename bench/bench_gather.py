"""Gather + aggregate against a bare tensor all-gather and ``all_gather_object``, gloo, world 2 and 4.

    python bench/bench_gather.py            # launches torchrun for each world size and prints a table

Each worker times, interleaved in rounds (the median round is reported): a bare ``all_gather_into_tensor`` of the same float64
vector rankmem sends; rankmem's gather + aggregate (``PackedGather`` and ``aggregate``, what
``Monitor.collect`` adds on top of probing); and ``all_gather_object`` of the same dict. Targets:
within 1.2x of the bare all-gather (issue 14; the first version's target was 1.5x), at least 2x faster
than ``all_gather_object``. ``bench/bench_overhead.py`` measures the whole ``collect()`` against it.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from collections.abc import Callable

from _torchrun import worker_result

KEYS = 64  # ~20 memory keys, 3 phases x 5, and a dozen of the caller's scalars
ITERS = 200
ROUNDS = 15  # interleaved; the median round of each case is reported (2 processes on 2 cores jitter)


def worker() -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from rankmem.exchange.aggregate import aggregate
    from rankmem.exchange.packed import PackedGather

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    keys = tuple(f"mem/key_{i:02d}_gib" for i in range(KEYS))
    values = [float(rank * 1000 + i) for i in range(KEYS)]
    data = dict(zip(keys, values, strict=True))
    gather = PackedGather()
    gather.gather(keys, values)  # learn the layout once, as the first collect does

    inp = torch.tensor([0.0, 0.0, *values], dtype=torch.float64)
    out = torch.empty(world * inp.numel(), dtype=torch.float64)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def bare() -> None:
        all_gather(out, inp)
        out.numpy()

    def ours() -> None:
        schemas, rows = gather.gather(keys, values)
        aggregate(keys, np.vstack(rows))

    def objects() -> None:
        got: list[object] = [None] * world
        dist.all_gather_object(got, data)

    cases: dict[str, Callable[[], None]] = {"bare": bare, "rankmem": ours, "object": objects}
    rounds: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(ROUNDS):
        for name, fn in cases.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(ITERS):
                fn()
            rounds[name].append((time.perf_counter() - start) / ITERS * 1e6)
    median = {k: sorted(v)[len(v) // 2] for k, v in rounds.items()}
    # Every rank waits on the slowest; report the max over ranks of each rank's median.
    t = torch.tensor(list(median.values()), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    worst = t.tolist()
    if rank == 0:
        print(json.dumps(dict(zip(cases, worst, strict=True))))
    assert gather.fallbacks == 1
    dist.destroy_process_group()


def main() -> None:
    print(f"{'world':>5s} {'bare us':>9s} {'rankmem us':>11s} {'object us':>10s} {'rankmem/bare':>13s} {'object/rankmem':>15s}")
    for world in (2, 4):
        r = worker_result(__file__, world)
        print(f"{world:5d} {r['bare']:9.1f} {r['rankmem']:11.1f} {r['object']:10.1f} "
              f"{r['rankmem'] / r['bare']:12.2f}x {r['object'] / r['rankmem']:14.2f}x")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        main()
