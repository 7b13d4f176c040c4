"""Run under torchrun by tests/test_reduce.py: the all-gather and the all-reduce paths of Exchange on the
same data, side by side in one gloo group; each rank writes what it got to OUT/rank<r>.json.

    python -m torch.distributed.run --nproc-per-node 4 tests/dist_scripts/reduce_worker.py OUT
"""

from __future__ import annotations

import datetime
import json
import math
import sys
import warnings
from typing import Any

import torch.distributed as dist

import rankmem
from rankmem.exchange.exchange import Exchange


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    gather = Exchange(reduce_above=10**9)
    reduce = Exchange(reduce_above=1, detail_every=3, detail_rank=1)  # forced low: this world reduces
    cases: list[dict[str, Any]] = []

    def both(name: str, values: dict[str, float], step: int, detail: bool = False) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            g = gather.gather_aggregate(values, step)
            r = reduce.gather_aggregate(values, step, detail=detail)
        cases.append({
            "name": name, "gather": g.aggregated, "reduce": r.aggregated,
            "gather_keys": list(g.keys), "reduce_keys": list(r.keys), "mixed": [g.mixed, r.mixed],
            "detail": None if r.matrix is None else r.matrix.tolist(), "gather_matrix": g.matrix.tolist(),
            "columns": r.columns(), "fallbacks": reduce.packed.fallbacks, "reduces": reduce.reduce.reduces,
            "warnings": [str(w.message) for w in caught],
        })

    # Ties (a = 5 on ranks 1 and 3), negatives, a large spread for the mean, a -inf.
    base = {"a": [1.0, 5.0, 2.0, 5.0][rank % 4], "b": -1.5 * rank, "c": 1e12 + rank / 3, "d": 1.0 / (rank + 1)}
    both("first", base, 0)  # learns the layout: the pickled fallback
    both("steady", base, 1)
    both("steady2", {**base, "b": -math.inf if rank == 2 else base["b"]}, 2)
    both("nan", {**base, "a": math.nan if rank in (2, 3) else base["a"]}, 3)  # first NaN: rank 2
    both("extra", {**base, **({"e": 7.0 + rank} if rank % 2 else {})}, 4)  # mixed: a fallback
    both("union", {**base, **({"e": 7.0 + rank} if rank % 2 else {})}, 5)  # the union: steady again
    both("gone", {k: v for k, v in base.items() if k != "c" or rank == 0}, 6)  # only rank 0 has c
    both("forced", base, 7, detail=rank == world - 1)  # one rank asks for the detail off cadence
    both("plain", base, 8)

    # A Monitor forced onto the reduce path writes a run log that the reader takes back.
    run_dir = f"{out}/run"
    monitor = rankmem.Monitor(sinks=("jsonl",), out_dir=run_dir, device="cpu", children=False)
    monitor._exchange.reduce_above, monitor._exchange.detail_every = 1, 2
    for step in range(5):
        monitor.collect({"tokens": 10.0 * (rank + 1)}, step=step)
    if rank == world - 1:
        monitor.request_detail()  # off cadence (collect 5 of detail_every=2): one rank asks
    monitor.collect({"tokens": 10.0 * (rank + 1)}, step=5)
    monitor.collect({"tokens": 10.0 * (rank + 1)}, step=6)  # on cadence again
    monitor.collect({"tokens": 10.0 * (rank + 1)}, step=7)  # none
    monitor.close()

    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "cases": cases}, f, allow_nan=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
