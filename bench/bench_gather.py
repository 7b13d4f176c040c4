"""Gather + aggregate and ``Monitor.collect()`` against a bare tensor all-gather, gloo, world 2 and 4.

    python bench/bench_gather.py            # launches torchrun for each world size and prints a table

Each worker times, interleaved in rounds: a bare ``all_gather_into_tensor`` of a float64 vector as long
as the one rankmem sends (64 keys and 1,000, with the 3-value header); rankmem's gather + aggregate
(``PackedGather`` and ``aggregate``); ``all_gather_object`` of the same dict; and ``Monitor.collect()``
with the caller's scalars making up 64 keys and 1,000 (no sinks, no leak watch: their thread is not
the training thread's). Wall time and this thread's CPU time; each round's ratio, median and IQR over
rounds. Targets: ``collect()`` within 1.5x of the bare all-gather (CPU) at world 2 and 4, 1,000 keys
in 0.4 ms, rankmem's own cost per key (over the bare gather's) under 0.3 us; gather + aggregate at
least 2x faster than ``all_gather_object``.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

from _torchrun import worker_result

KEYS = 64  # ~20 memory keys, 3 phases x 5, and a dozen of the caller's scalars
ITERS = 100
ROUNDS = 15  # interleaved; the median round of each case is reported (2 processes on 2 cores jitter)


def worker() -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import rankmem
    from rankmem.exchange.aggregate import aggregate
    from rankmem.exchange.packed import PackedGather

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    keys = tuple(f"mem/key_{i:02d}_gib" for i in range(KEYS))
    values = [float(rank * 1000 + i) for i in range(KEYS)]
    data = dict(zip(keys, values, strict=True))
    gather = PackedGather()
    gather.gather(keys, values)  # learn the layout once, as the first collect does
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    # Monitor.collect() as a training loop calls it, after a step window: no sinks and no leak watch
    # (their thread is not the training thread's time), the caller's scalars making up the keys.
    monitor = rankmem.Monitor(device="cpu", near_oom_watch=False, leak_check=False, children=False)

    def bare_of(n: int) -> Callable[[], None]:
        inp = torch.zeros(n + 3, dtype=torch.float64)
        out = torch.empty(world * inp.numel(), dtype=torch.float64)

        def bare() -> None:
            all_gather(out, inp)
            out.numpy()
        return bare

    def collect_of(n: int) -> Callable[[], None]:
        with monitor.step(0):
            pass
        own = len(monitor.collect())  # the memory keys' aggregates: 5 per key
        metrics = {f"user/metric_{i:04d}": float(rank + i) for i in range(n - own // 5)}

        def collect() -> None:
            monitor.collect(metrics)
        for _ in range(3):
            collect()  # the layout learnt (the first collects take the pickled path)
        return collect

    def ours() -> None:
        schemas, rows = gather.gather(keys, values)
        aggregate(keys, np.vstack(rows))

    def objects() -> None:
        got: list[object] = [None] * world
        dist.all_gather_object(got, data)

    cases: dict[str, Callable[[], None]] = {"bare": bare_of(KEYS), "rankmem": ours, "object": objects,
                                            "collect": collect_of(KEYS), "bare_1000": bare_of(1000)}
    cases["collect_1000"] = collect_of(1000)
    wall: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(ROUNDS):
        for name, fn in cases.items():
            dist.barrier()
            w = c = 0.0
            for _ in range(ITERS):
                if name.startswith("collect"):
                    with monitor.step():  # a step window closes before each collect, untimed
                        pass
                w0, c0 = time.perf_counter(), time.thread_time()
                fn()
                w, c = w + time.perf_counter() - w0, c + time.thread_time() - c0
            wall[name].append(w / ITERS * 1e6)
            cpu[name].append(c / ITERS * 1e6)
    # Every rank waits on the slowest: each figure is the max over ranks of the rank's value per round.
    t = torch.tensor([wall[k] for k in cases] + [cpu[k] for k in cases], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    rows = t.tolist()
    if rank == 0:
        print(json.dumps({"wall": dict(zip(cases, rows[: len(cases)], strict=True)),
                          "cpu": dict(zip(cases, rows[len(cases):], strict=True))}))
    assert gather.fallbacks == 1
    monitor.close()
    dist.destroy_process_group()


def spread(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4)
    return f"{statistics.median(xs):7.2f} ({q[0]:.2f}-{q[2]:.2f})"


def main() -> None:
    print(f"load {os.getloadavg()[0]:.1f}; {ROUNDS} rounds of {ITERS}; per round, the max over ranks; "
          "median (IQR) over rounds of each round's ratio")
    for world in (2, 4):
        r = worker_result(__file__, world)
        for clock in ("cpu", "wall"):
            x = r[clock]

            def ratio(a: str, b: str, x: dict[str, list[float]] = x) -> list[float]:
                return [p / q for p, q in zip(x[a], x[b], strict=True)]
            per_key = [((c1 - b1) - (c - b)) / (1000 - KEYS) for c1, b1, c, b in
                       zip(x["collect_1000"], x["bare_1000"], x["collect"], x["bare"], strict=True)]
            print(f"world {world}, {clock}: bare {statistics.median(x['bare']):.1f} us; "
                  f"gather+aggregate/bare {spread(ratio('rankmem', 'bare'))}; "
                  f"object/gather+aggregate {spread(ratio('object', 'rankmem'))}")
            print(f"  Monitor.collect(): {KEYS} keys {statistics.median(x['collect']):.1f} us, /bare "
                  f"{spread(ratio('collect', 'bare'))}; 1,000 keys "
                  f"{statistics.median(x['collect_1000']):.1f} us, "
                  f"/bare {spread(ratio('collect_1000', 'bare_1000'))}; own us per key {spread(per_key)}")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        main()
