"""Peak anatomy in the fit: the part of a window's peak that does not follow its work (docs/anatomy.md)."""

from __future__ import annotations

import numpy as np

HELD_PARTS = ("grads_low", "grads_high", "optimizer")
"""The anatomy's parts (``mem/phase/P/anatomy/<part>_gib``) :func:`held_state` takes, in its order."""


def held_state(low: np.ndarray | None, high: np.ndarray | None,
               optimizer: np.ndarray | None) -> tuple[np.ndarray | float, float]:
    """(per window, GiB to take off the rise; GiB to add to the baseline in its place), from each window's
    ``anatomy`` gradient range and optimizer state at its peak; (0, 0) without them.

    Gradients surely present (the range's low end) leave the rise, and the most that can be (the high end's
    largest) joins the baseline. A window that peaked before the optimizer state existed gets it back.
    """
    if low is None or high is None or optimizer is None:
        return 0.0, 0.0
    g = np.where(np.isfinite(low), low, 0.0)
    full = float(np.nanmax(optimizer)) if np.isfinite(optimizer).any() else 0.0
    o = np.where(np.isfinite(optimizer), optimizer, full)
    most = float(np.nanmax(high)) if np.isfinite(high).any() else 0.0
    return g - (full - o), most
