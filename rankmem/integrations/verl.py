"""verl integration: memory figures that ride verl's own data-parallel gather and reduce correctly.

verl's engine worker (``TrainingWorker._postprocess_output``, verl 0.9) all-gathers its metrics dict
over the data-parallel group, then adds ``perf/max_memory_*_gb`` and ``perf/cpu_memory_used_gb``
*after* the gather: rank-local lifetime peaks, and the node's system-wide used memory. The driver
keeps one DP rank's output and reduces every list with ``reduce_metrics``, whose rule is by key
name: a key containing ``max`` takes the max, else one containing ``min`` the min, else the mean.

:func:`metrics_for_gather` is called *before* the gather instead. It returns this rank's window
figures under names that rule reduces the way each figure means:

- every per-rank key ``K`` becomes ``K/max``, ``K/min`` and ``K/mean`` (a peak taken by ``mean``
  would hide the rank about to run out of memory, so the reduction is in the name). A name whose
  base already contains ``max`` or ``min`` (a phase called ``minibatch``) would be reduced by that
  word instead, so it is left out rather than emitted with a wrong value; ``K/max`` is always kept.
- ``K/max_rank`` cannot come out of a per-key reduce; it is in rankmem's own run log and
  :meth:`rankmem.Monitor.collect`.
- verl's names, per rank, with the corrected meaning: ``perf/max_memory_allocated_gb`` and
  ``perf/max_memory_reserved_gb`` are this window's peaks (the name says ``max``: max over ranks);
  ``perf/cpu_memory_used_gb`` is the process RSS (not the node's), which verl's rule averages over
  ranks because its name has no ``max``: the worst rank is ``mem/host/rss_gib/max``.

Each value is a one-element list, like verl's per-micro-batch metrics: ``train_mini_batch`` flattens
the gathered per-rank values with ``itertools.chain``, which needs lists, and ``reduce_metrics``
reduces a list of lists over all of its elements.

:func:`allgather_dict_into_dict` is a drop-in for verl's function of that name (same result: per key,
each rank's value in rank order, lists kept whole) that sends numbers in one tensor collective
instead of pickling, and falls back to a pickled gather only for values that are not numbers.
"""

from __future__ import annotations

from rankmem.core.catalogue import VERL_KEYS
from rankmem.exchange.dict_gather import VerlDictGather, allgather_dict_into_dict
from rankmem.monitor import Monitor

__all__ = ["VERL_NAMES", "VerlDictGather", "allgather_dict_into_dict", "metrics_for_gather", "verl_reduction"]

# verl's key -> the per-rank rankmem key whose value it carries (GiB: verl divides by 1024**3 too).
VERL_NAMES = {verl: ours.rsplit("/", 1)[0] for verl, ours in VERL_KEYS.items()}

_STATS = ("max", "min", "mean")


def verl_reduction(key: str) -> str:
    """The reduction verl's ``reduce_metrics`` applies to a plain list under ``key``."""
    if "max" in key:
        return "max"
    if "min" in key:
        return "min"
    return "mean"


def metrics_for_gather(monitor: Monitor) -> dict[str, list[float]]:
    """This rank's figures for the window since the last call, named for verl's ``reduce_metrics``.

    Local (no collective), so only the ranks that run ``_postprocess_output`` call it. Merge the
    result into the metrics dict before verl's data-parallel all-gather.
    """
    local = monitor.local_metrics()
    out: dict[str, list[float]] = {}
    for key, value in local.items():
        for stat in _STATS:
            name = f"{key}/{stat}"
            if verl_reduction(name) == stat:
                out[name] = [value]
    for verl_key, ours in VERL_NAMES.items():
        if ours in local:
            out[verl_key] = [local[ours]]
    return out
