"""verl by hand: memory figures that ride verl's own data-parallel gather and reduce correctly.

verl's ``TrainingWorker._postprocess_output`` (verl 0.9) all-gathers its metrics over the data-parallel
group, then adds ``perf/max_memory_*_gb`` (rank-local lifetime peaks) and ``perf/cpu_memory_used_gb``
(the node's used memory) *after* it; the driver keeps one rank's output and ``reduce_metrics`` reduces
each list by its key's name (``max``, else ``min``, else the mean). :func:`metrics_for_gather` gives this
rank's figures *before* the gather, under names that rule reduces the way each means (``K/max``,
``K/min``, ``K/mean``; verl's three keys with the corrected meaning), as one-element lists like verl's
micro-batch metrics. :func:`allgather_dict_into_dict` is a drop-in for verl's gather (numbers in one
tensor collective); :func:`tell_micro_batches` tells the monitor the work of verl's micro-batch split.
docs/integrations.md says the rules in full; :mod:`rankmem.integrations.verl._patch` applies them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rankmem.core.catalogue import VERL_KEYS
from rankmem.errors import RankmemError
from rankmem.exchange.dict_gather import VerlDictGather, allgather_dict_into_dict
from rankmem.monitor import Monitor

__all__ = ["VERL_NAMES", "VerlDictGather", "allgather_dict_into_dict", "metrics_for_gather",
           "tell_micro_batches", "verl_reduction"]

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
        names = _gather_names.get(key)
        if names is None:
            names = _names_for_gather(key)
        for name in names:
            out[name] = [value]
    for verl_key, ours in VERL_NAMES.items():
        if ours in local:
            out[verl_key] = [local[ours]]
    return out


def _names_for_gather(key: str) -> tuple[str, ...]:
    """The names under which verl's ``reduce_metrics`` applies to ``key`` the statistic each name says
    (``peak_gib/max`` is maxed; a key with "min" in it is also min'd under ``/min``)."""
    names = tuple(f"{key}/{stat}" for stat in _STATS if verl_reduction(f"{key}/{stat}") == stat)
    if len(_gather_names) < _GATHER_NAMES_KEPT:  # every step asks again for the same few dozen keys
        _gather_names[key] = names
    return names


_gather_names: dict[str, tuple[str, ...]] = {}
_GATHER_NAMES_KEPT = 4096
"""A bound on the memo: a caller's per-step unique keys must not grow it for the life of the job."""


def tell_micro_batches(monitor: Monitor, micro_batches: Sequence[Any], *, seqlens: Any = None) -> None:
    """Tell ``monitor`` the work of every micro-batch of a split, in one call inside the phase.

    Either verl's micro-batches (TensorDicts, ``DataProto``s or dicts whose nested ``input_ids`` or 2-D
    ``attention_mask`` give the lengths; rows of length 0 are padding), or, with ``seqlens=``, its index
    lists, ``seqlens`` being this rank's own per-sequence lengths in the batch's order (a list, or the
    batch's 2-D attention mask). Lengths from a list cost no device copy.
    """
    if seqlens is None:
        for micro_batch in micro_batches:
            _tell(monitor, _lengths(micro_batch))
        return
    lengths = _mask_lengths(seqlens) if _is_tensor(seqlens) else _int_list(seqlens, "seqlens")
    if any(n < 0 for n in lengths):
        raise RankmemError("tell_micro_batches: seqlens holds a negative length")
    splits = [_int_list(indices, f"index list {n}") for n, indices in enumerate(micro_batches)]
    for n, idx in enumerate(splits):  # all checked before any is told: a refused split leaves no trace
        bad = [i for i in idx if not 0 <= i < len(lengths)]
        if bad:
            raise RankmemError(f"tell_micro_batches: index list {n} holds {bad[0]}, outside the "
                               f"{len(lengths)} sequences of seqlens: pass the lengths of the batch that was split")
    for idx in splits:
        _tell(monitor, [lengths[i] for i in idx])


def _tell(monitor: Monitor, lengths: list[int]) -> None:
    live = [n for n in lengths if n > 0]
    monitor.micro_batch(sum(live), len(live), sum(n * n for n in live))


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "dim") and hasattr(value, "sum") and hasattr(value, "tolist")


def _lengths(micro_batch: Any) -> list[int]:
    if not isinstance(micro_batch, Mapping) and hasattr(micro_batch, "batch"):
        micro_batch = micro_batch.batch  # a DataProto: its tensors
    try:
        ids = micro_batch["input_ids"] if "input_ids" in micro_batch else None
        mask = micro_batch["attention_mask"] if "attention_mask" in micro_batch else None
    except TypeError:
        ids = mask = None
    if ids is not None and getattr(ids, "is_nested", False):
        return _int_list(ids.offsets().diff().tolist(), "input_ids offsets")
    if mask is not None and _is_tensor(mask):
        return _mask_lengths(mask)
    raise RankmemError(f"tell_micro_batches: expected a verl micro-batch holding a 2-D 'attention_mask' or "
                       f"nested 'input_ids', got {type(micro_batch).__name__}: pass the micro-batches verl's "
                       "split returns, or its index lists with seqlens=")


def _mask_lengths(mask: Any) -> list[int]:
    if mask.dim() != 2:
        raise RankmemError(f"tell_micro_batches: the attention mask must be 2-D (sequences x positions), "
                           f"got {mask.dim()}-D: pass the per-sequence lengths with seqlens= instead")
    return _int_list(mask.sum(dim=-1).tolist(), "attention mask")


def _int_list(values: Any, what: str) -> list[int]:
    try:
        out = [int(v) for v in values]
    except (TypeError, ValueError):
        raise RankmemError(f"tell_micro_batches: {what} must be integers, got {values!r:.80}") from None
    return out
