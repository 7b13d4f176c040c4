"""Run under torchrun by tests/test_own_memory.py and docs/overhead.md: ranks doing identical work, each
writing its RSS (``/proc/self/statm``) after the last step, and whether pyarrow is loaded, to OUT/rank<r>.rss.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_scripts/symmetric_rss_worker.py OUT MODE

MODE ``none``: no Monitor (the baseline); ``monitor``: a Monitor without sinks; ``runlog``: a Monitor
writing the run log to OUT/run (the default sinks).
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

STEPS = 30


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(out: str, mode: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    monitor = None
    if mode != "none":
        import rankmem

        out_dir = os.path.join(out, "run") if mode == "runlog" else None
        monitor = rankmem.Monitor(out_dir=out_dir, sinks=None if mode == "runlog" else ())
    model = torch.nn.Linear(256, 256)
    for step in range(STEPS):
        x = torch.randn(32, 256)
        if monitor is not None:
            with monitor.step(step), monitor.phase("update"):
                model(x).sum().backward()
            monitor.collect({"loss": 1.0})
        else:
            model(x).sum().backward()
            dist.all_reduce(torch.zeros(8))
    if monitor is not None:
        monitor.flush(10.0)
    dist.barrier()
    with open(os.path.join(out, f"rank{rank}.rss"), "w") as f:
        f.write(f"{rss()} {int('pyarrow' in sys.modules)}")
    dist.barrier()
    if monitor is not None:
        monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
