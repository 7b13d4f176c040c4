"""Run under torchrun by tests/test_faults.py (2 ranks): misuse that must not hang or kill a rank.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_scripts/faults_worker.py OUT
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import warnings

import torch.distributed as dist

import rankmem


def forked_child_collect(monitor: rankmem.Monitor) -> int:
    """Exit status of a forked child that calls collect(): 0 when it got a RankmemError."""
    pid = os.fork()
    if pid == 0:
        try:
            monitor.collect({"x": 1.0})
        except rankmem.RankmemError:
            os._exit(0)
        except BaseException:
            os._exit(2)
        os._exit(1)  # the child went into the parent's collective
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    monitor = rankmem.Monitor(sinks=(), device="cpu", children=False)
    result: dict[str, object] = {"rank": rank}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # 7. a number beyond float64 (10**400) on one rank, a non-dict on the other: both reach the collective.
        huge = monitor.collect({"tokens": 10**400 if rank == 1 else 5, "ok": 1.0})
        not_a_dict = monitor.collect(["loss", 1.0] if rank == 0 else {"loss": 2.0})  # type: ignore[arg-type]
    result["huge"] = {k: huge[k] for k in ("tokens/max", "tokens/max_rank", "ok/max") if k in huge}
    result["not_a_dict_loss_max"] = not_a_dict.get("loss/max")
    result["warnings"] = [str(w.message) for w in caught]
    # 10. a forked child of a rank calling collect() is refused before it touches the process group.
    result["fork_child_status"] = forked_child_collect(monitor) if rank == 0 else 0
    # 10. a rank outside the Monitor's subgroup gets a clear error, not "the group has -1 rank(s)".
    only_rank0 = dist.new_group([0])
    sub = rankmem.Monitor(sinks=(), device="cpu", children=False, group=only_rank0)
    try:
        sub.collect({"x": 1.0})
        result["subgroup"] = "collected"
    except rankmem.RankmemError as exc:
        result["subgroup"] = str(exc)
    # 8. rank 1's keys change every step (A on even steps, B on odd): after the union is learned, no
    # pickled gather per step and a bounded number of warnings; rank 0's NaN still propagates.
    before = monitor.fallbacks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alternating = []
        for step in range(12):
            extra = {("A" if step % 2 == 0 else "B"): float(step)} if rank == 1 else {}
            got = monitor.collect({"loss": float("nan") if (rank == 0 and step == 11) else 1.0, **extra})
            alternating.append({k: got.get(k) for k in ("A/max", "A/max_rank", "B/max", "B/max_rank", "loss/max_rank")})
    result["alternating"] = alternating
    result["alternating_fallbacks"] = monitor.fallbacks - before
    result["alternating_warnings"] = len(caught)
    # The parent's group still works after all of the above.
    result["after"] = monitor.collect({"z": float(rank)})["z/max"]
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
