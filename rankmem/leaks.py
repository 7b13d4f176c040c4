"""Leak detection: is a rank's memory still growing, steadily, after warm-up?

For each rank and each baseline series (host RSS, device allocated, dataloader-worker RSS) we look at
the last part of the run only (by default its second half), so a warm-up that levels off is not
flagged, and ask three things:

- **Theil–Sen slope** (median of all pairwise slopes): the growth rate in MiB/step, robust to spikes
  such as a checkpoint save; its confidence interval follows Sen (1968) from the Mann–Kendall variance.
- **Mann–Kendall test**: is the series monotonically increasing, rank-based so no noise model is
  assumed. The one-sided p-value must be below ``alpha``.
- **Minimum total growth** over the window: a statistically clear but tiny drift (a few KiB/step of
  allocator caches) is not worth an alarm.
- **No give-back**: a leak never returns memory, a cache that fills and empties does. The largest
  persistent fall in the window (after a 9-step running median that drops one-step spikes) must stay
  under half the growth, so a sawtooth is not flagged. A one-time permanent jump still is.

Long windows are first reduced to at most ``max_points`` block medians, which keeps the O(n²) pairwise
work at ~32k pairs (about a millisecond) and damps the short-range autocorrelation that makes
Mann–Kendall over-confident on raw memory series.

:func:`detect_leaks` works offline on a :class:`rankmem.runlog.Run`; :class:`LeakWatch` is fed each
step record on the logging rank and warns once per rank and series. Statistics are plain numpy: the
library does not depend on scipy.
"""

from __future__ import annotations

import collections
import math
import statistics
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rankmem._records import StepRecord
from rankmem.errors import RankmemError
from rankmem.runlog import Run

__all__ = ["LEAK_KEYS", "LeakConfig", "LeakWatch", "Trend", "detect_leaks", "mann_kendall", "theil_sen", "trend"]

LEAK_KEYS = ("mem/host/rss_gib", "mem/device/allocated_gib", "mem/host/children_rss_gib")
"""The baseline series: what a leak grows. Peaks and reserved memory follow them, with more noise."""

_MIB_PER_GIB = 1024.0
_NORMAL = statistics.NormalDist()


@dataclass(frozen=True)
class LeakConfig:
    """When a growing series counts as a leak. Validated on construction."""

    window: float = 0.5
    """Fraction of the logged steps examined, counted from the end: warm-up before it is ignored."""
    last: int | None = None
    """Examine the last ``last`` logged steps instead of a fraction."""
    min_steps: int = 20
    """Fewer logged steps in the window give no verdict."""
    alpha: float = 0.01
    """Largest one-sided Mann–Kendall p-value that counts as growth."""
    min_growth_mib: float = 64.0
    """Smallest growth over the window (slope x steps spanned) worth flagging, in MiB."""
    max_points: int = 256
    """Longer windows are reduced to this many block medians before the pairwise statistics."""

    def __post_init__(self) -> None:
        if not 0.0 < self.window <= 1.0:
            raise RankmemError(f"leak window must be a fraction in (0, 1], got {self.window}")
        if self.last is not None and self.last < 3:
            raise RankmemError(f"leak window 'last' must be at least 3 steps, got {self.last}")
        if self.min_steps < 3:
            raise RankmemError(f"min_steps must be at least 3, got {self.min_steps}")
        if not 0.0 < self.alpha < 1.0:
            raise RankmemError(f"alpha must be in (0, 1), got {self.alpha}")
        if self.min_growth_mib < 0:
            raise RankmemError(f"min_growth_mib must be >= 0, got {self.min_growth_mib}")
        if self.max_points < 8:
            raise RankmemError(f"max_points must be at least 8, got {self.max_points}")


@dataclass(frozen=True)
class Trend:
    """One rank's series over the examined window, and the verdict."""

    key: str
    rank: int
    first_step: int
    last_step: int
    n: int
    """Logged steps examined (before block medians)."""
    slope_mib: float
    """Theil–Sen growth rate, MiB per step."""
    low_mib: float
    high_mib: float
    """95% confidence interval of the slope, MiB per step."""
    p_value: float
    """One-sided Mann–Kendall p-value for an increasing series."""
    growth_mib: float
    """``slope_mib`` times the steps spanned by the window."""
    drawdown_mib: float
    """Largest persistent fall inside the window (after a 9-step running median), MiB."""
    leak: bool

    @property
    def confidence(self) -> float:
        """1 - p: how sure the test is that the series grows."""
        return 1.0 - self.p_value

    def describe(self) -> str:
        return (
            f"rank {self.rank} {self.key}: {self.slope_mib:+.3f} MiB/step "
            f"(95% CI {self.low_mib:+.3f}..{self.high_mib:+.3f}, p={self.p_value:.1e}), "
            f"{self.growth_mib:+.1f} MiB over steps {self.first_step}..{self.last_step}"
        )


def mann_kendall(y: np.ndarray) -> tuple[float, float, float]:
    """(S, variance of S with the ties correction, one-sided p-value that ``y`` increases)."""
    y = np.asarray(y, dtype=float)
    n = y.size
    if n < 3:
        return 0.0, 0.0, 1.0
    i, j = np.triu_indices(n, 1)
    s = float(np.sign(y[j] - y[i]).sum())
    _, counts = np.unique(y, return_counts=True)
    ties = counts[counts > 1].astype(float)
    var = (n * (n - 1) * (2 * n + 5) - float((ties * (ties - 1) * (2 * ties + 5)).sum())) / 18.0
    if var <= 0 or s <= 0:
        return s, max(var, 0.0), 1.0 if s <= 0 else 0.5
    z = (s - 1.0) / math.sqrt(var)  # continuity correction: S moves in steps of 2
    return s, var, 0.5 * math.erfc(z / math.sqrt(2.0))  # the upper tail, without 1 - cdf underflow


def theil_sen(x: np.ndarray, y: np.ndarray, confidence: float = 0.95) -> tuple[float, float, float]:
    """(slope, low, high): the median pairwise slope and Sen's confidence interval."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    i, j = np.triu_indices(x.size, 1)
    dx = x[j] - x[i]
    keep = dx != 0
    slopes = np.sort((y[j] - y[i])[keep] / dx[keep])
    if slopes.size == 0:
        return math.nan, math.nan, math.nan
    slope = float(np.median(slopes))
    _, var, _ = mann_kendall(y)
    c = _NORMAL.inv_cdf(0.5 + confidence / 2) * math.sqrt(var)
    m = slopes.size
    # Sen's limits are the (m - c)/2-th and (m + c)/2-th ordered slopes (rounded, as scipy does).
    lo = int(np.clip(round((m - c) / 2) - 1, 0, m - 1))
    hi = int(np.clip(round((m + c) / 2), 0, m - 1))
    return slope, float(slopes[lo]), float(slopes[hi])


def _block_medians(x: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    n = x.size
    if n <= max_points:
        return x, y
    size = -(-n // max_points)
    blocks = n // size
    # Drop the oldest remainder, not the newest: the end of the run matters most.
    xs = x[n - blocks * size :].reshape(blocks, size)
    ys = y[n - blocks * size :].reshape(blocks, size)
    return np.median(xs, axis=1), np.median(ys, axis=1)


def _window(n: int, config: LeakConfig) -> int:
    """How many of the last ``n`` points to examine."""
    if config.last is not None:
        return min(n, config.last)
    return max(int(math.ceil(n * config.window)), min(n, config.min_steps))


def trend(steps: np.ndarray, values_gib: np.ndarray, key: str, rank: int, config: LeakConfig | None = None) -> Trend | None:
    """The verdict for one series (GiB values against step numbers); None when too short to judge."""
    config = config or LeakConfig()
    ok = np.isfinite(values_gib)
    x, y = np.asarray(steps, dtype=float)[ok], np.asarray(values_gib, dtype=float)[ok] * _MIB_PER_GIB
    take = _window(x.size, config)
    if take < config.min_steps:
        return None
    x, y = x[-take:], y[-take:]
    xb, yb = _block_medians(x, y, config.max_points)
    slope, low, high = theil_sen(xb, yb)
    if math.isnan(slope):
        return None
    _, _, p = mann_kendall(yb)
    growth = slope * float(x[-1] - x[0])
    # A leak never gives memory back; a cache that fills and empties (a sawtooth) does. The largest
    # persistent fall (after a 9-step running median, which removes one-step spikes) must stay small
    # next to the growth.
    smooth = np.median(np.lib.stride_tricks.sliding_window_view(y, 9), axis=1) if y.size >= 9 else y
    drawdown = float((np.maximum.accumulate(smooth) - smooth).max())
    leak = slope > 0 and p < config.alpha and growth >= config.min_growth_mib and drawdown <= 0.5 * growth
    return Trend(
        key=key,
        rank=rank,
        first_step=int(x[0]),
        last_step=int(x[-1]),
        n=int(take),
        slope_mib=slope,
        low_mib=low,
        high_mib=high,
        p_value=p,
        growth_mib=growth,
        drawdown_mib=drawdown,
        leak=bool(leak),
    )


def detect_leaks(run: Run, keys: Sequence[str] = LEAK_KEYS, config: LeakConfig | None = None) -> list[Trend]:
    """A :class:`Trend` for each rank of each ``keys`` series present in ``run`` (enough steps given)."""
    config = config or LeakConfig()
    out: list[Trend] = []
    for key in keys:
        matrix = run.series.get(key)
        if matrix is None:
            continue
        for rank in range(matrix.shape[1]):
            t = trend(run.steps, matrix[:, rank], key, rank, config)
            if t is not None:
                out.append(t)
    return out


class LeakWatch:
    """Online leak check on the logging rank: feed it every step record; it warns once per rank and key.

    Keeps the last ``capacity`` records of each baseline series and, after ``warmup`` records, re-tests
    every ``check_every`` records, so its cost is a few milliseconds per ``check_every`` steps, independent of run length.
    """

    def __init__(
        self,
        config: LeakConfig | None = None,
        keys: Sequence[str] = LEAK_KEYS,
        check_every: int = 50,
        capacity: int = 2000,
        warmup: int = 200,
    ) -> None:
        if check_every < 1 or capacity < 3 or warmup < 0:
            raise RankmemError("LeakWatch needs check_every >= 1, capacity >= 3 and warmup >= 0")
        self.warmup = warmup
        self.config = config or LeakConfig()
        self.keys = tuple(keys)
        self.check_every = check_every
        self._steps: collections.deque[int] = collections.deque(maxlen=capacity)
        self._values: dict[str, collections.deque[list[float | None] | None]] = {
            k: collections.deque(maxlen=capacity) for k in self.keys
        }
        self._fed = 0
        self.flagged: dict[tuple[str, int], Trend] = {}
        """(key, rank) -> the first trend that was flagged."""

    def feed(self, record: StepRecord) -> list[Trend]:
        """Add one step; every ``check_every`` steps, test and return the newly flagged trends."""
        self._steps.append(record.step)
        for key in self.keys:
            self._values[key].append(record.ranks.get(key))
        self._fed += 1
        # Online we cannot yet see a warm-up level off, so the first ``warmup`` records are never judged.
        if self._fed < self.warmup or self._fed % self.check_every:
            return []
        return self.check()

    def check(self) -> list[Trend]:
        """Test now; warn for and return trends flagged for the first time."""
        steps = np.fromiter(self._steps, dtype=np.int64, count=len(self._steps))
        new: list[Trend] = []
        for key, column in self._values.items():
            if not any(v is not None for v in column):
                continue
            world = max(len(v) for v in column if v is not None)
            matrix = np.full((len(column), world), np.nan)
            for i, vec in enumerate(column):
                if vec is not None:
                    matrix[i, : len(vec)] = [math.nan if v is None else v for v in vec]
            for rank in range(world):
                if (key, rank) in self.flagged:
                    continue
                t = trend(steps, matrix[:, rank], key, rank, self.config)
                if t is not None and t.leak:
                    self.flagged[(key, rank)] = t
                    new.append(t)
                    warnings.warn(f"rankmem: possible memory leak on {t.describe()}", RuntimeWarning, stacklevel=2)
        return new
