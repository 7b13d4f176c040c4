"""Leak statistics: is a rank's memory still growing, steadily, after warm-up?

For each rank and each baseline series (the catalogue's ``LEAK_KEYS``: host RSS, dataloader-worker RSS,
device allocated) we look at the last part of the run only (by default its second half), so a warm-up
that levels off is not flagged, and ask:

- **Theil–Sen slope** (median of all pairwise slopes): the growth rate in MiB/step, robust to spikes
  such as a checkpoint save; its confidence interval follows Sen (1968) from the Mann–Kendall variance.
- **Mann–Kendall test**: is the series monotonically increasing, rank-based so no noise model is
  assumed. The one-sided p-value must be below ``alpha``.
- **Minimum total growth** over the window: a statistically clear but tiny drift (a few KiB/step of
  allocator caches) is not worth an alarm.
- **No give-back**: a leak never returns memory, a cache that fills and empties does. The largest
  persistent fall in the window (after a 9-step running median that drops one-step spikes) must stay
  under half the growth, so a sawtooth is not flagged.
- **Not one level shift**: a one-time permanent jump (a cache allocated once) rises and never falls.
  When two flat levels around the best single change point fit the window much better than the line,
  and the part after the change grows at no rate that matters, the series is not flagged and
  :attr:`Trend.reason` says so. Only would-be leaks pay for this check.

Long windows are first reduced to at most ``max_points`` block medians, which keeps the O(n²) pairwise
work at ~32k pairs per series and damps the short-range autocorrelation that makes Mann–Kendall
over-confident on raw memory series. Ranks with the same steps are judged together, one numpy pass
over all their pairs.

:class:`LeakWatch` is fed each collect's gathered values on the logging rank and warns once per rank
and series; :func:`rankmem.leaks.detect_leaks` runs the same verdicts offline over a run log. This
module is online code: it imports neither the run-log reader nor the report. Statistics are plain
numpy: the library does not depend on scipy.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rankmem._catalogue import LEAK_KEYS
from rankmem._records import StepRecord
from rankmem.errors import RankmemError, warn

__all__ = ["LEAK_KEYS", "LeakConfig", "LeakWatch", "Trend", "mann_kendall", "theil_sen", "trend", "trends"]

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
    reason: str = ""
    """Why a growing series was not flagged, when that was the level-shift check ("level shift of
    +N MiB at step S"); empty otherwise. The other fields say why for the other checks."""

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


_PAIRS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The index pairs ``i < j`` of ``n`` points, built once per length: the online watch asks for the
    same few lengths on every check."""
    pairs = _PAIRS.get(n)
    if pairs is None:
        if len(_PAIRS) >= 16:
            _PAIRS.clear()
        i, j = np.triu_indices(n, 1)
        i.flags.writeable = j.flags.writeable = False
        pairs = _PAIRS[n] = (i, j)
    return pairs


def _pair_differences(rows: np.ndarray) -> np.ndarray:
    """``rows[:, j] - rows[:, i]`` over all pairs ``i < j``, a row at a time: numpy's fast path for a 1-D
    gather is 3-10x quicker here than the same gather on the 2-D array."""
    i, j = _pairs(rows.shape[1])
    out = np.empty((rows.shape[0], i.size))
    for r, row in enumerate(rows):
        np.subtract(row[j], row[i], out=out[r])
    return out


def _tie_variance(rows: np.ndarray) -> np.ndarray:
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


def _upper_p(s: float, var: float) -> float:
    """One-sided p-value that the series increases, from S and its variance."""
    if var <= 0 or s <= 0:
        return 1.0 if s <= 0 else 0.5
    z = (s - 1.0) / math.sqrt(var)  # continuity correction: S moves in steps of 2
    return 0.5 * math.erfc(z / math.sqrt(2.0))  # the upper tail, without 1 - cdf underflow


def _sen(dx: np.ndarray, dy: np.ndarray, var: np.ndarray, confidence: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
    c = _NORMAL.inv_cdf(0.5 + confidence / 2) * np.sqrt(var)
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
    s = float(np.sign(_pair_differences(row)).sum())
    var = max(float(_tie_variance(row)[0]), 0.0)
    return s, var, _upper_p(s, var)


def theil_sen(x: np.ndarray, y: np.ndarray, confidence: float = 0.95) -> tuple[float, float, float]:
    """(slope, low, high): the median pairwise slope and Sen's confidence interval."""
    dx = _pair_differences(np.asarray(x, dtype=float).reshape(1, -1))[0]
    row = np.asarray(y, dtype=float).reshape(1, -1)
    slope, low, high = _sen(dx, _pair_differences(row), _tie_variance(row), confidence)
    return float(slope[0]), float(low[0]), float(high[0])


def _block_medians(x: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
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


def _window(n: int, config: LeakConfig) -> int:
    """How many of the last ``n`` points to examine."""
    if config.last is not None:
        return min(n, config.last)
    return max(int(math.ceil(n * config.window)), min(n, config.min_steps))


def _trend_columns(x: np.ndarray, y: np.ndarray, key: str, ranks: Sequence[int], config: LeakConfig) -> list[Trend | None]:
    """The verdicts for the columns of ``y`` (MiB, no gaps; column c is rank ``ranks[c]``) against the
    shared steps ``x``, in one numpy pass: the pairwise work is what costs, and it vectorises across ranks."""
    take = _window(x.size, config)
    if take < config.min_steps:
        return [None] * len(ranks)
    x, y = x[-take:], y[-take:]
    xb, yb = _block_medians(x, y, config.max_points)
    rows = np.ascontiguousarray(yb.T)
    dy = _pair_differences(rows)
    var = _tie_variance(rows)
    slope, low, high = _sen(_pair_differences(xb.reshape(1, -1))[0], dy, var, 0.95)
    p = [_upper_p(float(s), float(v)) for s, v in zip(np.sign(dy).sum(axis=1), var, strict=True)]
    growth = slope * float(x[-1] - x[0])
    # A leak never gives memory back; a cache that fills and empties (a sawtooth) does. The largest
    # persistent fall (after a 9-step running median, which removes one-step spikes) must stay small
    # next to the growth. The 5th of 9 sorted values is the median; partition finds it without a sort.
    if y.shape[0] >= 9:
        smooth = np.partition(np.lib.stride_tricks.sliding_window_view(y, 9, axis=0), 4, axis=-1)[..., 4]
    else:
        smooth = y
    drawdown = (np.maximum.accumulate(smooth, axis=0) - smooth).max(axis=0)
    grows = (slope > 0) & (np.asarray(p) < config.alpha) & (growth >= config.min_growth_mib) & (drawdown <= 0.5 * growth)
    reasons = [""] * len(ranks)
    if grows.any():
        # Only the series that would be flagged pay for the level-shift check.
        cand = np.flatnonzero(grows)
        xs = x[4:-4] if y.shape[0] >= 9 else x
        for col, why in zip(cand, _level_shifts(xs, smooth[:, cand], slope[cand], xb, yb[:, cand], config), strict=True):
            if why:
                grows[col] = False
                reasons[col] = why
    out: list[Trend | None] = []
    for c, rank in enumerate(ranks):
        if math.isnan(slope[c]):
            out.append(None)
            continue
        out.append(Trend(
            key=key,
            rank=rank,
            first_step=int(x[0]),
            last_step=int(x[-1]),
            n=int(take),
            slope_mib=float(slope[c]),
            low_mib=float(low[c]),
            high_mib=float(high[c]),
            p_value=p[c],
            growth_mib=float(growth[c]),
            drawdown_mib=float(drawdown[c]),
            leak=bool(grows[c]),
            reason=reasons[c],
        ))
    return out


# Level-shift check, tuned on bench/bench_leaks.py's series. The two-level model's median absolute
# residual over the line's is about 0.2-0.7 for a +100 MiB jump and 0.8-2.7 for a 0.25 MiB/step leak
# (10th-90th percentiles): below 0.7 the jump explains the series better.
_SHIFT_RATIO = 0.7
_SHIFT_MIN_SIDE = 0.1
"""Each level spans at least this fraction of the window: a split near an end fits a spike or the
warm-up's tail, not a shift."""
_SHIFT_KEEP_RATE = 0.3
"""A post-shift rate at least this fraction of the window's slope is still a leak's growth."""


def _level_shifts(xs: np.ndarray, smooth: np.ndarray, slope: np.ndarray, xb: np.ndarray, yb: np.ndarray,
                  config: LeakConfig) -> list[str]:
    """For each column of ``smooth`` (points x series, the running-median series at steps ``xs``), a
    reason string when its growth is one level shift rather than a steady climb, else "".

    A permanent jump (a cache allocated once) passes the slope, Mann-Kendall and give-back checks: the
    series rises and never falls. What tells it from a leak is its shape: two flat levels fit it better
    than a line does, and after the jump nothing grows. We fit the best single change point (two means,
    chosen by least squares through cumulative sums: O(n) per series) and compare the median absolute
    residual of the two medians' model with that of the Theil-Sen line. Then the part after the change
    point must show no trend of its own (Mann-Kendall on the block medians), so a leak that starts
    mid-window, or a jump followed by a leak, is still flagged."""
    n, width = smooth.shape
    out = [""] * width
    span = float(xb[-1] - xb[0])
    side = max(3, int(n * _SHIFT_MIN_SIDE))
    if n < 2 * side + 1:
        return out
    c = np.cumsum(smooth, axis=0)
    k = np.arange(side, n - side + 1)  # split before index k: left is [:k]
    left = c[k - 1] / k[:, None]
    right = (c[-1] - c[k - 1]) / (n - k)[:, None]
    score = (k * (n - k) / n)[:, None] * (right - left) ** 2
    best = k[np.argmax(score, axis=0)]
    idx = np.arange(n)[:, None]
    before = idx < best
    lo_level = np.nanmedian(np.where(before, smooth, np.nan), axis=0)
    hi_level = np.nanmedian(np.where(before, np.nan, smooth), axis=0)
    step_res = np.median(np.abs(smooth - np.where(before, lo_level, hi_level)), axis=0)
    line = smooth - slope * xs[:, None]
    line_res = np.median(np.abs(line - np.median(line, axis=0)), axis=0)
    for col in range(width):
        if not (hi_level[col] > lo_level[col] and step_res[col] < _SHIFT_RATIO * line_res[col]):
            continue
        at = xs[best[col]]
        keep = xb >= at
        after = yb[keep, col]
        if after.size >= 3 and mann_kendall(after)[2] < config.alpha:
            # Slow wander after a jump often tests significant too (the points are autocorrelated),
            # so the rate must also matter: a third of the window's slope (a slow leak whose noise
            # looks step-like keeps growing at about its own rate), or enough to reach the minimum
            # growth over the window (a slow leak after a big jump).
            rate = theil_sen(xb[keep], after)[0]
            if rate >= _SHIFT_KEEP_RATE * slope[col] or rate * span >= config.min_growth_mib:
                continue
        out[col] = f"level shift of {hi_level[col] - lo_level[col]:+.1f} MiB at step {int(at)}"
    return out


def trend(steps: np.ndarray, values_gib: np.ndarray, key: str, rank: int, config: LeakConfig | None = None) -> Trend | None:
    """The verdict for one series (GiB values against step numbers); None when too short to judge."""
    values = np.asarray(values_gib, dtype=float)
    ok = np.isfinite(values)
    x = np.asarray(steps, dtype=float)[ok]
    return _trend_columns(x, values[ok, None] * _MIB_PER_GIB, key, [rank], config or LeakConfig())[0]


# Ranks judged in one pass: 64 ranks x 32k pairs keeps the pairwise arrays near 17 MB each.
_BATCH = 64


def trends(steps: np.ndarray, columns_gib: np.ndarray, key: str, ranks: Sequence[int], config: LeakConfig) -> list[Trend]:
    """Trends of the columns of ``columns_gib`` (steps x series; column c is rank ``ranks[c]``), by rank.

    Columns without gaps share their steps and are judged together; a column with gaps has its own
    window and is judged alone; an empty one (a key this rank never reported) is skipped."""
    finite = np.isfinite(columns_gib)
    whole = [c for c in range(len(ranks)) if finite[:, c].all()]
    x = np.asarray(steps, dtype=float)
    out: list[Trend | None] = []
    for start in range(0, len(whole), _BATCH):
        cols = whole[start : start + _BATCH]
        out += _trend_columns(x, columns_gib[:, cols] * _MIB_PER_GIB, key, [ranks[c] for c in cols], config)
    for c in range(len(ranks)):
        if finite[:, c].any() and c not in whole:
            out.append(trend(steps, columns_gib[:, c], key, ranks[c], config))
    return sorted((t for t in out if t is not None), key=lambda t: t.rank)


class LeakWatch:
    """Online leak check on the logging rank: feed it every collect; it warns once per rank and key.

    Keeps the last ``capacity`` values of each baseline series in numpy ring buffers. After ``warmup``
    feeds, each (key, rank) series is re-tested once every ``check_every`` feeds, and those tests are
    spread evenly over the feeds instead of all falling on one: the other ranks wait at the next
    collective for whatever a feed costs. At world 64 that is 3-4 of the 192 series per feed, a few
    milliseconds; testing all of them at once took 0.6-0.8 s. :meth:`check` still tests everything now.
    """

    def __init__(
        self,
        config: LeakConfig | None = None,
        keys: Sequence[str] = LEAK_KEYS,
        check_every: int = 250,
        capacity: int = 2000,
        warmup: int = 200,
    ) -> None:
        if check_every < 1 or capacity < 3 or warmup < 0:
            raise RankmemError("LeakWatch needs check_every >= 1, capacity >= 3 and warmup >= 0")
        self.warmup = warmup
        self.config = config or LeakConfig()
        self.keys = tuple(keys)
        self.check_every = check_every
        self.capacity = capacity
        self._steps = np.zeros(capacity, dtype=np.int64)
        self._values = np.full((capacity, len(self.keys), 0), np.nan)
        """Ring buffer: row (slot) x key x rank, GiB; widened to the world size at the first feed."""
        self._next = 0
        self._count = 0
        self._fed = 0
        self._cursor = 0
        """The next series to test, counting key-major over (key, rank)."""
        self._credit = check_every - 1  # so that the first series is tested on the warm-up's last feed
        self._columns: tuple[tuple[str, ...], np.ndarray] = ((), np.zeros(0, dtype=np.intp))
        self.flagged: dict[tuple[str, int], Trend] = {}
        """(key, rank) -> the first trend that was flagged."""

    def feed_matrix(self, step: int, keys: Sequence[str], matrix: np.ndarray) -> list[Trend]:
        """Add one collect as the monitor gathers it: ``matrix[rank, i]`` is the rank's ``keys[i]``
        (nan where absent). Only the watched keys' columns are read. Returns newly flagged trends."""
        keys = tuple(keys)
        if keys != self._columns[0]:  # the key set rarely changes: look the columns up once per set
            where = {k: i for i, k in enumerate(keys)}
            self._columns = (keys, np.array([where.get(k, -1) for k in self.keys], dtype=np.intp))
        cols = self._columns[1]
        row = np.full((len(self.keys), matrix.shape[0]), np.nan)
        present = cols >= 0
        row[present] = matrix[:, cols[present]].T
        return self._push(step, row)

    def feed(self, record: StepRecord) -> list[Trend]:
        """Add one step record (per-rank lists); returns the trends flagged for the first time."""
        vectors = [record.ranks.get(key) for key in self.keys]
        row = np.full((len(self.keys), max((len(v) for v in vectors if v is not None), default=0)), np.nan)
        for k, vec in enumerate(vectors):
            if vec is not None:
                row[k, : len(vec)] = [math.nan if v is None else v for v in vec]
        return self._push(record.step, row)

    def _push(self, step: int, row: np.ndarray) -> list[Trend]:
        world = row.shape[1]
        if world > self._values.shape[2]:  # the first feed (or more ranks than before): widen, nan-padded
            wider = np.full((self.capacity, len(self.keys), world), np.nan)
            wider[:, :, : self._values.shape[2]] = self._values
            self._values = wider
        slot = self._next
        self._steps[slot] = step
        self._values[slot] = np.nan
        self._values[slot, :, :world] = row
        self._next = (slot + 1) % self.capacity
        self._count = min(self._count + 1, self.capacity)
        self._fed += 1
        # Online we cannot yet see a warm-up level off, so the first ``warmup`` feeds are never judged.
        if self._fed < self.warmup:
            return []
        series = self._values.shape[1] * self._values.shape[2]
        due, self._credit = divmod(self._credit + series, self.check_every)
        picked = [(self._cursor + i) % series for i in range(min(due, series))]
        if not picked:
            return []
        self._cursor = (picked[-1] + 1) % series
        ranks_of: dict[int, list[int]] = {}
        for s in picked:
            ranks_of.setdefault(s // self._values.shape[2], []).append(s % self._values.shape[2])
        return self._judge(ranks_of)

    def check(self) -> list[Trend]:
        """Test every series now; warn for and return trends flagged for the first time."""
        everyone = list(range(self._values.shape[2]))
        return self._judge({k: everyone for k in range(len(self.keys))})

    def _judge(self, ranks_of: dict[int, list[int]]) -> list[Trend]:
        """Test the given ranks of the given keys (by index) on the buffered window."""
        order = (self._next - self._count + np.arange(self._count)) % self.capacity
        steps = self._steps[order]
        new: list[Trend] = []
        for k, ranks in ranks_of.items():
            key = self.keys[k]
            todo = [r for r in ranks if (key, r) not in self.flagged]
            if not todo:
                continue
            columns = self._values[order[:, None], k, np.asarray(todo)]
            for t in trends(steps, columns, key, todo, self.config):
                if t.leak:
                    self.flagged[(key, t.rank)] = t
                    new.append(t)
                    warn(f"rankmem: possible memory leak on {t.describe()}", stacklevel=3)
        return new
