"""Leak detection over a run log: is a rank's memory still growing, steadily, after warm-up?

:func:`detect_leaks` judges every rank's baseline series of a :class:`rankmem.offline.Run` (host RSS,
device allocated, dataloader-worker RSS by default) with the verdicts of :mod:`rankmem.trend.trend`:
Theil–Sen slope, Mann–Kendall test, growth against the series' noise and against what is at stake, no
give-back, and growth spread over the steps; that module's docstring says how and why. Each leak then names
the phase that leaves its growth behind and when, at its rate, the memory it grows into runs out
(:mod:`rankmem.trend.outlook`). The same verdicts run online in :class:`LeakWatch` on the logging rank;
its names are re-exported here, so ``rankmem.offline.leaks`` is the one public place for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from rankmem.offline import Run
from rankmem.publish.leakwatch import LeakWatch
from rankmem.trend import outlook as _outlook
from rankmem.trend.trend import (
    LEAK_KEYS,
    LeakConfig,
    Trend,
    mann_kendall,
    outlook,
    phase_delta_keys,
    regression_axis,
    theil_sen,
    trend,
    trends,
)

__all__ = ["LEAK_KEYS", "LeakConfig", "LeakWatch", "Trend", "detect_leaks", "mann_kendall", "theil_sen", "trend"]


def worst_first(found: Sequence[Trend]) -> list[Trend]:
    """The leaks among ``found``, worst first: the soonest to exhaust its memory, then the fastest growing."""
    return sorted((t for t in found if t.leak), key=lambda t: (
        t.exhaustion.step if t.exhaustion is not None else float("inf"), -t.slope_mib, t.rank))


def _hosts(run: Run, world: int) -> list[object]:
    """Each rank's host from the run header (a rank without one is a node of its own)."""
    hosts: list[object] = [("rank", r) for r in range(world)]
    for info in run.header.ranks:
        if 0 <= info.rank < world and info.host:
            hosts[info.rank] = info.host
    return hosts


def _latest(column: np.ndarray) -> float | None:
    ok = np.flatnonzero(np.isfinite(column))
    return float(column[ok[-1]]) if ok.size else None


def detect_leaks(run: Run, keys: Sequence[str] = LEAK_KEYS, config: LeakConfig | None = None) -> list[Trend]:
    """A :class:`Trend` for each rank of each ``keys`` series present in ``run`` (enough steps given);
    leaks come with their phase and time to exhaustion where the log holds what those need."""
    config = config or LeakConfig()
    present = [k for k in keys if k in run.series]
    if not present:
        return []
    world = run.series[present[0]].shape[1]
    hosts = _hosts(run, world)
    sharing = [hosts.count(h) for h in hosts]
    context = [{k: _latest(run.series[k][:, r]) if k in run.series else None for k in _outlook.CONTEXT_KEYS}
               for r in range(world)]
    found: list[Trend] = []
    x, axis = regression_axis(run.steps)
    for key in present:
        matrix = run.series[key]
        caps = [_outlook.capacity_gib(key, context[r], sharing[r]) for r in range(matrix.shape[1])]
        found += [t if axis == "step" else replace(t, axis=axis)
                  for t in trends(x, matrix, key, range(matrix.shape[1]), config, caps)]
    if not any(t.leak for t in found):
        return found

    def rows(t: Trend) -> np.ndarray:
        return (x >= t.first_step) & (x <= t.last_step)

    def current(t: Trend) -> float | None:
        where = rows(t)
        return _outlook.fitted_last(x[where], run.series[t.key][where, t.rank], t.slope_mib, t.last_step)

    def deltas(t: Trend) -> dict[str, np.ndarray]:
        return {p: run.series[k][rows(t), t.rank] for p, k in phase_delta_keys(t.key, list(run.series)).items()}

    window = x[-max(t.n for t in found):]
    pace = _outlook.seconds_per_step(window, run.times[-window.size:])
    return outlook(found, current, lambda r: context[r], lambda r: hosts[r], pace, deltas)
