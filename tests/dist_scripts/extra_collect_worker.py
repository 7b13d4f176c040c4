"""Run under torchrun by tests/test_faults.py (2 ranks): rank 1 calls collect() once more than rank 0.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_scripts/extra_collect_worker.py OUT
"""

from __future__ import annotations

import datetime
import json
import sys
import warnings

import torch.distributed as dist

import rankmem


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    monitor = rankmem.Monitor(sinks=(), device="cpu", children=False)
    result: dict[str, object] = {"rank": rank}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.collect({"x": 1.0}, step=1)
        if rank == 1:
            monitor.collect({"x": 2.0}, step=1)  # the extra call: it meets rank 0's next collect
        else:
            monitor.collect({"x": 3.0}, step=2)
    result["warnings"] = [str(w.message) for w in caught if "at different steps" in str(w.message)]
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    if rank == 1:
        try:  # rank 1's last collect has no partner: it fails when rank 0 leaves or at the timeout
            monitor.collect({"x": 3.0}, step=2)
        except Exception:  # noqa: BLE001
            pass
    monitor.close()


if __name__ == "__main__":
    main(sys.argv[1])
