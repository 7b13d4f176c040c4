"""Leak detection over a run log: is a rank's memory still growing, steadily, after warm-up?

:func:`detect_leaks` judges every rank's baseline series of a :class:`rankmem.runlog.Run` (host RSS,
device allocated, dataloader-worker RSS by default) with the statistics of :mod:`rankmem._trend`:
Theil–Sen slope, Mann–Kendall test, minimum growth, no give-back and not one level shift; that
module's docstring says how. The same verdicts run online in :class:`LeakWatch` on the logging rank;
its names are re-exported here, so ``rankmem.leaks`` is the one public place for both.
"""

from __future__ import annotations

from collections.abc import Sequence

from rankmem._trend import LEAK_KEYS, LeakConfig, LeakWatch, Trend, mann_kendall, theil_sen, trend, trends
from rankmem.runlog import Run

__all__ = ["LEAK_KEYS", "LeakConfig", "LeakWatch", "Trend", "detect_leaks", "mann_kendall", "theil_sen", "trend"]


def detect_leaks(run: Run, keys: Sequence[str] = LEAK_KEYS, config: LeakConfig | None = None) -> list[Trend]:
    """A :class:`Trend` for each rank of each ``keys`` series present in ``run`` (enough steps given)."""
    config = config or LeakConfig()
    out: list[Trend] = []
    for key in keys:
        matrix = run.series.get(key)
        if matrix is not None:
            out += trends(run.steps, matrix, key, range(matrix.shape[1]), config)
    return out
