"""Run under torchrun by tests/test_collective.py: each rank writes what it got to OUT/rank<r>.json.

    python -m torch.distributed.run --nproc-per-node 3 tests/dist_scripts/gather_worker.py OUT
"""

from __future__ import annotations

import datetime
import json
import math
import sys
import warnings

import numpy as np
import torch.distributed as dist

import rankmem

MIB = 1 << 20


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    monitor = rankmem.Monitor(sinks=(), device="cpu", children=False)
    result: dict[str, object] = {"rank": rank}

    # 1. rank r holds a different, known amount of host memory and its own scalars.
    held = np.ones((rank + 1) * 64 * MIB, dtype=np.uint8)
    with monitor.step(0):
        with monitor.phase("rollout"):
            spike = np.ones((3 - rank) * 128 * MIB, dtype=np.uint8)  # rank 0 peaks highest: 448 MiB
            del spike
    first = monitor.collect({"tokens": 100 * (rank + 1), "loss": rank + 0.5})
    result["first"] = first
    result["fallbacks_after_first"] = monitor.fallbacks

    # 2. the same keys again: the fast path (no pickled gather).
    with monitor.step(1):
        pass
    second = monitor.collect({"tokens": 100 * (rank + 1), "loss": rank + 0.5})
    result["second_tokens_max"] = second["tokens/max"]
    result["fallbacks_after_second"] = monitor.fallbacks

    # 3. rank 1 adds a key the others lack: no hang, the same result everywhere, one warning.
    extra = {"extra": 7.0} if rank == 1 else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mixed = monitor.collect({"tokens": 1.0, **extra})
    result["mixed"] = mixed
    result["mixed_warnings"] = [str(w.message) for w in caught]
    result["fallbacks_after_mixed"] = monitor.fallbacks

    # 4. a NaN on one rank (a diverged loss) propagates and is named, not averaged away.
    nan_case = monitor.collect({"loss": math.nan if rank == 0 else float(rank)})
    result["nan_loss"] = {k: nan_case[k] for k in ("loss/max", "loss/min", "loss/mean", "loss/max_rank")}

    # 5. verl's allgather_dict_into_dict drop-in: scalars and lists, rank order.
    result["dict"] = rankmem.allgather_dict_into_dict({"a": float(rank), "lst": [rank, rank * 10]})

    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f, allow_nan=True)
    del held
    monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
