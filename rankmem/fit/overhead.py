"""The caching allocator's overhead at a phase's peak: reserved over allocated, as a ratio.

Only the windows that grew the pool show what a window of their size needs, and that grows with the
allocation, so a ratio carries to a larger T where a difference does not. Pure numpy, shared by
``rankmem advise`` and the online watch.
"""

from __future__ import annotations

import numpy as np


def grew_pool(peak_reserved: np.ndarray, peak_allocated: np.ndarray, reserved_rise: np.ndarray | None,
              before: float = -np.inf) -> np.ndarray:
    """Per window: was the pool it started with too small for its peak allocation, so that the
    allocator grew it for this window? The pool at the window's start is its reserved peak less its
    rise where the rise is logged, else the largest reserved peak of the windows before it (and
    ``before``, the largest of those left out ahead of these). A rise alone is not enough: a window
    served from a large cached pool may still cut a new 2 MiB segment for small blocks, and its ratio
    would then be the old pool's."""
    reserved = np.asarray(peak_reserved, dtype=np.float64)
    alloc = np.asarray(peak_allocated, dtype=np.float64)
    if reserved_rise is not None:
        start = reserved - np.asarray(reserved_rise, dtype=np.float64)
    else:
        start = np.fmax.accumulate(np.concatenate(([before], reserved[:-1]))) if reserved.size else reserved
    with np.errstate(invalid="ignore"):
        return (start < alloc) & (reserved > start)


def overhead_ratio(peak_allocated: np.ndarray, peak_reserved: np.ndarray, grew: np.ndarray) -> float:
    """Peak reserved over peak allocated: the largest over the windows that grew the pool; where none
    did (the pool covered every window), at the window of the largest allocation, an upper bound of its
    own; 1.0 where nothing is known. Never under 1."""
    alloc = np.asarray(peak_allocated, dtype=np.float64)
    reserved = np.asarray(peak_reserved, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        ok = np.isfinite(alloc) & np.isfinite(reserved) & (alloc > 0)
        ratio = np.where(ok, reserved / np.where(ok, alloc, 1.0), np.nan)
    chosen = np.asarray(grew, dtype=bool) & ok
    if chosen.any():
        return max(float(ratio[chosen].max()), 1.0)
    if not ok.any():
        return 1.0
    return max(float(ratio[ok][np.argmax(alloc[ok])]), 1.0)
