"""The statistics behind the leak verdicts, plain numpy (the library does not depend on scipy).

Rank-based trend statistics (Theil–Sen slope with Sen's interval, the Mann–Kendall test), robust
noise and smoothing helpers. Series are rows (or columns, where the docstring says so) so that the
ranks of one key go through one numpy pass; the policy that turns these numbers into a verdict lives
in :mod:`rankmem.trend.trend`.
"""

from __future__ import annotations

import math
import threading

import numpy as np

_MAD_TO_SD = 1.4826  # the MAD of a normal sample times this estimates its standard deviation

_PAIRS_LOCK = threading.Lock()
PAIRS_AT_LEAST = 256
"""Points the index pairs are first built for: the 256 block medians a window is reduced to by default
(:attr:`rankmem.trend.trend.LeakConfig.max_points`), 0.5 MiB."""
PAIRS_KEPT_UP_TO = 1024
"""Longer series get pairs of their own that are not kept (1,024 points' pairs are 8 MiB)."""
_pairs: tuple[np.ndarray, np.ndarray] = (np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.intp))


def _build_pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Every pair ``i < j`` of ``n`` points, ordered by ``j`` then ``i``: the pairs of the first ``m``
    points are then the first ``m * (m - 1) / 2``."""
    counts = np.arange(1, n, dtype=np.intp)  # point j >= 1 pairs with the j points before it
    j = np.repeat(counts, counts)
    i = np.arange(j.size, dtype=np.intp) - np.repeat(counts * (counts - 1) // 2, counts)
    i.flags.writeable = j.flags.writeable = False
    return i, j


def pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The index pairs ``i < j`` of ``n`` points (ordered by ``j``, then ``i``): views of one pair of
    arrays, built for :data:`PAIRS_AT_LEAST` points or the most asked since. Why one: the online watch's
    window grows by a point each check until it reaches its 256, and a pair of arrays per length
    (kept for the last few lengths, or built afresh each time) made the logging rank's RSS climb 3.4 MiB
    over collects 150-500 (the arrays and the heap their churn left), which its leak watch then
    reported against that rank."""
    global _pairs
    if n > PAIRS_KEPT_UP_TO:  # a long raw series (``theil_sen`` called directly): built, used, let go
        return _build_pairs(n)
    with _PAIRS_LOCK:  # two monitors' publisher threads may judge at once
        i, j = _pairs
        if j.size == 0 or int(j[-1]) < n - 1:
            i, j = _pairs = _build_pairs(max(n, PAIRS_AT_LEAST))
    m = n * (n - 1) // 2
    return i[:m], j[:m]


def pair_differences(rows: np.ndarray) -> np.ndarray:
    """``rows[:, j] - rows[:, i]`` over all pairs ``i < j``, a row at a time: numpy's fast path for a 1-D
    gather is 3-10x quicker here than the same gather on the 2-D array."""
    i, j = pairs(rows.shape[1])
    out = np.empty((rows.shape[0], i.size))
    for r, row in enumerate(rows):
        np.subtract(row[j], row[i], out=out[r])
    return out


def tie_variance(rows: np.ndarray) -> np.ndarray:
    """Variance of the Mann–Kendall S of each row of ``rows`` (series x points), ties corrected."""
    width, n = rows.shape
    ordered = np.sort(rows, axis=1)
    starts = np.ones(rows.shape, dtype=bool)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    # Each run of equal values gets one id, distinct across rows, so one bincount sizes every tie group.
    group = np.cumsum(starts, axis=1) - 1 + n * np.arange(width)[:, None]
    t = np.bincount(group.ravel(), minlength=width * n).reshape(width, n).astype(float)
    var: np.ndarray = (n * (n - 1) * (2 * n + 5) - (t * (t - 1) * (2 * t + 5)).sum(axis=1)) / 18.0
    return var


def upper_p(s: float, var: float) -> float:
    """One-sided p-value that the series increases, from S and its variance."""
    if var <= 0 or s <= 0:
        return 1.0 if s <= 0 else 0.5
    z = (s - 1.0) / math.sqrt(var)  # continuity correction: S moves in steps of 2
    return 0.5 * math.erfc(z / math.sqrt(2.0))  # the upper tail, without 1 - cdf underflow


def sen(dx: np.ndarray, dy: np.ndarray, var: np.ndarray, confidence: float) -> tuple[np.ndarray, np.ndarray,
                                                                                     np.ndarray]:
    """Theil–Sen slope and Sen's interval of each row of pairwise differences ``dy`` (series x pairs)."""
    keep = dx != 0
    if not keep.all():
        dx, dy = dx[keep], dy[:, keep]
    m = dx.size
    if m == 0:
        nan = np.full(dy.shape[0], math.nan)
        return nan, nan, nan
    slopes = np.sort(dy / dx, axis=1)
    # The mean of the two middle slopes for an even count, exactly as np.median computes it.
    slope = slopes[:, m // 2] if m % 2 else (slopes[:, m // 2 - 1] + slopes[:, m // 2]) / 2
    from statistics import NormalDist  # here: ~3 ms of every `rankmem` command's start

    c = NormalDist().inv_cdf(0.5 + confidence / 2) * np.sqrt(var)
    # Sen's limits are the (m - c)/2-th and (m + c)/2-th ordered slopes (rounded half to even, as scipy).
    lo = np.clip(np.round((m - c) / 2) - 1, 0, m - 1).astype(np.intp)
    hi = np.clip(np.round((m + c) / 2), 0, m - 1).astype(np.intp)
    rows = np.arange(slopes.shape[0])
    return slope, slopes[rows, lo], slopes[rows, hi]


def mann_kendall(y: np.ndarray) -> tuple[float, float, float]:
    """(S, variance of S with the ties correction, one-sided p-value that ``y`` increases)."""
    row = np.asarray(y, dtype=float).reshape(1, -1)
    if row.size < 3:
        return 0.0, 0.0, 1.0
    s = float(np.sign(pair_differences(row)).sum())
    var = max(float(tie_variance(row)[0]), 0.0)
    return s, var, upper_p(s, var)


def theil_sen(x: np.ndarray, y: np.ndarray, confidence: float = 0.95) -> tuple[float, float, float]:
    """(slope, low, high): the median pairwise slope and Sen's confidence interval."""
    dx = pair_differences(np.asarray(x, dtype=float).reshape(1, -1))[0]
    row = np.asarray(y, dtype=float).reshape(1, -1)
    slope, low, high = sen(dx, pair_differences(row), tie_variance(row), confidence)
    return float(slope[0]), float(low[0]), float(high[0])


def block_medians(x: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_points`` block medians of ``x`` and of each column of ``y`` (points x series)."""
    n = x.size
    if n <= max_points:
        return x, y
    size = -(-n // max_points)
    blocks = n // size
    # Drop the oldest remainder, not the newest: the end of the run matters most.
    xs = x[n - blocks * size :].reshape(blocks, size)
    ys = y[n - blocks * size :].reshape(blocks, size, y.shape[1])
    return np.median(xs, axis=1), np.median(ys, axis=1)


def running_median(y: np.ndarray, width: int = 9) -> np.ndarray:
    """The running median of each column of ``y`` (points x series) over ``width`` points (odd), the
    same length as ``y``: near the ends the window shrinks to the points there are (at least
    ``width // 2 + 1``), so a one-point spike at an end is dropped like any other."""
    n, half = y.shape[0], width // 2
    if n < width:
        return np.broadcast_to(np.median(y, axis=0), y.shape).copy()
    out = np.empty_like(y)
    # The middle of `width` sorted values is the median; partition finds it without a sort.
    out[half : n - half] = np.partition(np.lib.stride_tricks.sliding_window_view(y, width, axis=0), half,
                                        axis=-1)[..., half]
    for k in range(half):
        out[k] = np.median(y[: k + half + 1], axis=0)
        out[n - 1 - k] = np.median(y[n - k - half - 1 :], axis=0)
    return out


def robust_sd(v: np.ndarray) -> np.ndarray:
    """Standard deviation of each column of ``v`` from its median absolute deviation: spikes (a
    checkpoint save) and a few level shifts barely move it."""
    med = np.median(v, axis=0)
    sd: np.ndarray = _MAD_TO_SD * np.median(np.abs(v - med), axis=0)
    return sd


_ABS_Q25 = 0.3186
"""The lower quartile of |N(0, 1)|."""


def step_sd(y: np.ndarray) -> np.ndarray:
    """The step-to-step (white) noise of each column of ``y`` (points x series): the lower quartile of
    the first differences' absolute deviations from their median, scaled to a normal's sd. A step end's
    spike moves two differences: spikes on a third of the steps spoil over half of them, and the MAD
    with them (40 MiB spikes read as 40 MiB of noise); the lower quartile holds while a quarter of the
    differences are clean."""
    d = np.diff(y, axis=0)
    sd: np.ndarray = np.quantile(np.abs(d - np.median(d, axis=0)), 0.25, axis=0) / (_ABS_Q25 * math.sqrt(2))
    return sd
