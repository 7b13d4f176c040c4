"""rankmem in a verl-shaped engine worker: memory figures ride the data-parallel gather.

Run:  python -m torch.distributed.run --nproc-per-node 2 examples/verl_example.py

``postprocess_output`` has the shape of verl's ``TrainingWorker._postprocess_output``; the driver's
reduce uses verl's rule (max / min / mean by key name), as ``verl.utils.metric.reduce_metrics`` does.
The ``update`` phase is told its micro-batches as verl's split gives them (index lists into the
rank's mini-batch) with the mini-batch's attention mask: the heaviest one's tokens ride the gather too.
"""

from __future__ import annotations

import datetime

import numpy as np
import torch
import torch.distributed as dist

import rankmem
from rankmem.integrations.verl import (
    allgather_dict_into_dict,
    metrics_for_gather,
    tell_micro_batches,
    verl_reduction,
)


def postprocess_output(monitor: rankmem.Monitor, metrics: dict, dp_group=None) -> dict:
    metrics.update(metrics_for_gather(monitor))  # before the gather: every DP rank's figures take part
    return allgather_dict_into_dict(metrics, group=dp_group)  # verl's gather, or this drop-in


def driver_reduce(metrics: dict) -> dict:
    reduce = {"max": np.max, "min": np.min, "mean": np.mean}
    return {k: float(reduce[verl_reduction(k)](v)) for k, v in metrics.items()}


dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
monitor = rankmem.Monitor(sinks=())  # on every rank of the data-parallel group
held = torch.ones((rank + 1) * 128 * 2**20 // 4)  # rank r holds (r + 1) * 128 MiB
mask = torch.zeros(4, 16, dtype=torch.long)
for row, length in enumerate([8, 3 + 4 * rank, 5, 2]):  # the mini-batch's sequence lengths on this rank
    mask[row, :length] = 1
with monitor.phase("update"):
    tell_micro_batches(monitor, [[0, 3], [1, 2]], seqlens=mask)  # verl's index lists, e.g. rearrange_micro_batches'
gathered = postprocess_output(monitor, {"actor/pg_loss": [0.5 + rank, 0.25]})
reduced = driver_reduce(gathered)
if rank == 0:
    for key in ("mem/host/rss_gib/max", "mem/host/rss_gib/min", "perf/cpu_memory_used_gb", "actor/pg_loss",
                "mem/phase/update/heaviest_mb_tokens/max"):
        print(f"{key}: {reduced[key]:.3f}")
dist.destroy_process_group()
