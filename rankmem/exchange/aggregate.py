"""The aggregation math over a gathered (rank x key) matrix: max, min, mean and the ranks that hold them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rankmem.core.catalogue import AGGREGATES
from rankmem.core.records import per_rank_lists
from rankmem.exchange.reduce import QUANTILE_NAMES

SUFFIXES = tuple("/" + a for a in AGGREGATES)
QUANTILE_SUFFIXES = tuple("/" + q for q in QUANTILE_NAMES)  # K/p50, K/p90, K/p99: the all-reduce path's


_names_cache: dict[tuple[tuple[str, ...], tuple[str, ...]], tuple[list[str], dict[str, float]]] = {}


def names_of(keys: Sequence[str], suffixes: tuple[str, ...]) -> tuple[list[str], dict[str, float]]:
    """``K`` + each suffix per key, and a dict of them to copy and fill (15% cheaper than a dict grown key by
    key at 5,000 names); cached: layouts rarely change (the cache is kept from growing)."""
    at = (tuple(keys), suffixes)
    got = _names_cache.get(at)
    if got is None:
        if len(_names_cache) > 64:
            _names_cache.clear()
        names = [k + suffix for k in at[0] for suffix in suffixes]
        got = _names_cache[at] = (names, dict.fromkeys(names, math.nan))
    return got


def aggregate(keys: Sequence[str], matrix: np.ndarray, nan_is_absent: bool = False,
              absent: np.ndarray | None = None) -> dict[str, float]:
    """``K/max``, ``K/min``, ``K/mean``, ``K/max_rank``, ``K/min_rank`` per column of a ranks x keys matrix.

    A NaN the caller sent propagates to max, min and mean, and both ranks name the first rank holding it.
    ``absent`` (a boolean matrix) marks ranks without a key: they are left out; a key no rank has gives NaN
    (ranks -1). ``nan_is_absent=True`` takes every NaN as absent (a run log's ``null``).
    """
    if nan_is_absent:
        absent = np.isnan(matrix)
    # One (5 x keys) block whose rows the reductions fill in place: contiguous outputs, cheaper cold.
    stats = np.empty((len(SUFFIXES), matrix.shape[1]))
    if absent is None or not absent.any():
        matrix.max(axis=0, out=stats[0])
        matrix.min(axis=0, out=stats[1])
        matrix.sum(axis=0, out=stats[2])
        stats[2] /= max(matrix.shape[0], 1)
        stats[3] = matrix.argmax(axis=0)
        stats[4] = matrix.argmin(axis=0)
    else:
        present = ~absent
        counts = present.sum(axis=0)
        none = counts == 0
        high = np.where(present, matrix, -math.inf)
        low = np.where(present, matrix, math.inf)
        with np.errstate(invalid="ignore", divide="ignore"):
            stats[2] = np.where(present, matrix, 0.0).sum(axis=0) / np.maximum(counts, 1)
        stats[0] = high.max(axis=0)
        stats[1] = low.min(axis=0)
        stats[3] = high.argmax(axis=0)
        stats[4] = low.argmin(axis=0)
        stats[:3, none] = math.nan
        stats[3:, none] = -1
    names, blank = names_of(keys, SUFFIXES)
    out = blank.copy()
    out.update(zip(names, stats.T.ravel().tolist(), strict=True))
    return out


# A rank without a key sends this NaN: its payload tells "absent" from a NaN the caller sent. Gathers
# copy bytes (gloo, NCCL, pickled floats), so the payload survives.
ABSENT_BITS = np.uint64(0x7FF8_0000_DEAD_0001)


ABSENT = float(np.array([ABSENT_BITS]).view(np.float64)[0])


def absent_mask(matrix: np.ndarray) -> np.ndarray:
    return np.asarray(matrix.view(np.uint64) == ABSENT_BITS)


def union_matrix(schemas: Sequence[Sequence[str]], rows: Sequence[np.ndarray]) -> tuple[list[str], np.ndarray]:
    """Align per-rank ``(keys, values)`` on the sorted union of keys, :data:`ABSENT` where a rank lacks one."""
    keys = sorted(set().union(*schemas))
    col = {k: j for j, k in enumerate(keys)}
    matrix = np.full((len(rows), len(keys)), ABSENT)
    for r, (schema, row) in enumerate(zip(schemas, rows, strict=True)):
        for k, v in zip(schema, row, strict=True):
            matrix[r, col[k]] = v
    return keys, matrix


@dataclass(slots=True)
class Gathered:
    """One collect's aggregates, the same on every rank, and (when this collect carries it) the per-rank detail."""

    keys: Sequence[str]
    """Sorted per-rank keys (the union over ranks when they disagreed)."""
    matrix: np.ndarray | None
    """ranks x keys, float64; NaN where a rank lacked a key (only when ``mixed``) or sent NaN. None on
    purpose where this collect carries no per-rank detail: past :attr:`Exchange.reduce_above` ranks the
    detail reaches only the detail rank, every ``detail_every`` collects (see :mod:`rankmem.exchange.reduce`)."""
    aggregated: dict[str, float]
    """``K/max``, ``K/min``, ``K/mean``, ``K/max_rank``, ``K/min_rank`` for every key."""
    mixed: bool
    """True when ranks sent different keys (each key aggregated over the ranks that have it)."""

    def columns(self) -> dict[str, list[float | None]]:
        """Per key, each rank's value (``None`` where absent): the run log's per-rank part; empty when
        this collect carries no detail (the run log line then holds the aggregates only)."""
        if self.matrix is None:
            return {}
        return per_rank_lists(self.keys, self.matrix)
