"""Leak verdicts: is a rank's memory still growing, steadily, after warm-up?

For each rank and each baseline series (the catalogue's ``LEAK_KEYS``) we look at the last part of the run
only (by default its second half), so a warm-up that levels off is not flagged, and ask (the statistics
are in :mod:`rankmem.trend.stats`):

- **Does it grow?** Theil–Sen slope with Sen's 95% interval, and a one-sided Mann–Kendall test below
  ``alpha``: both robust to spikes and assume no noise model.
- **Is the growth large against the noise and against what is at stake?** The growth over the window
  must clear ``noise_factor`` noise standard deviations (memory series wander, so Mann–Kendall alone is
  over-confident) plus a floor: a share (``capacity_fraction``) of the memory the series grows into,
  else ``min_growth_mib``.
- **No give-back**: the largest persistent fall must stay under half the growth, so a sawtooth is not
  flagged.
- **The shape of the window**: growth that ended and then held is a warm-up or a filled cache; growth
  carried by 1-3 jumps is a cache allocated once or a few. A leak is growth spread over the steps, and
  :attr:`Trend.story` says what it did.
- **Refreshed figures are judged on their refreshes**: a figure read on its own cadence repeats its last
  reading between refreshes, so only the collects where its value changes are judged.

Long windows are reduced to at most ``max_points`` block medians, which bounds the O(n²) pairwise work.
A flagged series is placed in its context by :mod:`rankmem.trend.outlook`. :class:`LeakWatch` runs these
verdicts online; :func:`rankmem.offline.leaks.detect_leaks` offline over a run log. This module is online
code: it imports neither the run-log reader nor the report.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from rankmem.core.catalogue import LEAK_KEYS, PHASE_DELTA, PHASE_PREFIX, REFRESHED_KEYS
from rankmem.core.thresholds import LeakConfig as LeakConfig
from rankmem.core.units import MIB_PER_GIB
from rankmem.trend import outlook as _outlook
from rankmem.trend.outlook import Exhaustion
from rankmem.trend.stats import (
    block_medians,
    mann_kendall,
    pair_differences,
    robust_sd,
    running_median,
    sen,
    step_sd,
    theil_sen,
    tie_variance,
    upper_p,
)

__all__ = ["LEAK_KEYS", "LeakConfig", "Trend", "mann_kendall", "theil_sen", "trend", "trends"]


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
    noise_mib: float
    """The series' noise: the larger of its robust spread around the line and step to step, MiB."""
    bar_mib: float
    """The growth a leak must reach: ``noise_factor`` x noise + the stakes floor, MiB."""
    drawdown_mib: float
    """Largest persistent fall inside the window (after a 9-step running median), MiB."""
    leak: bool
    reason: str = ""
    """Why a clear trend (growing, Mann–Kendall significant) was not flagged; empty otherwise."""
    story: str = ""
    """What a would-be leak's window did, in words: ``grew +140.0 MiB from step 81 to 150, then held``."""
    phase: str | None = None
    """For a leak: the phase whose deltas carry the growth (``update``), where one clearly does."""
    exhaustion: Exhaustion | None = None
    """For a leak: when the memory it grows into runs out at this rate, where that is known."""
    axis: str = "step"
    """What ``first_step``, ``last_step`` and the slope count: ``step`` numbers, or ``collect`` (the
    collect's place in the run) where the step numbers do not rise (numbered per epoch)."""

    @property
    def confidence(self) -> float:
        """1 - p: how sure the test is that the series grows."""
        return 1.0 - self.p_value

    def describe(self) -> str:
        text = (
            f"rank {self.rank} {self.key}: {self.slope_mib:+.3f} MiB/{self.axis} "
            f"(95% CI {self.low_mib:+.3f}..{self.high_mib:+.3f}, p={self.p_value:.1e}), "
            f"{self.growth_mib:+.1f} MiB over {self.axis}s {self.first_step}..{self.last_step}"
        )
        if self.axis == "collect":
            text += " (the step numbers do not rise through the run, so collects are counted)"
        if self.leak and self.story:
            text += f"; {self.story}"
        if self.phase is not None:
            text += f"; growth is left behind by phase {self.phase!r}"
        if self.exhaustion is not None:
            text += f"; {self.exhaustion.describe()}"
        return text


# ---- the verdict -------------------------------------------------------------------------------------

_MIN_REFRESHES = 6
"""The fewest refreshes of a refreshed figure judged: the fewest points whose Mann–Kendall test can
reach the default alpha of 0.01 (6 rising points: p = 0.004)."""
_MAX_JUMPS = 3
_JUMPS_SHARE = 0.5
"""Growth whose largest 1-3 jumps (of the smoothed series) carry more than this share of it came at a
few steps: a cache allocated once, or a few; a leak spreads its growth over the steps."""
_JUMP_SD = 4.0
"""A jump rises this many standard deviations of the noise above the window's median span rise."""
_DRAWDOWN_WIDTH = 9
"""The give-back is measured on a running median this wide: it drops spikes of up to 4 steps."""
_MAX_DEPTH = 3
"""How many times the part after a shift is judged again (each time a shorter part)."""
_NORMAL_95 = 1.645
_MAD_SE = 1.167
"""Standard error of the MAD estimate of a normal sample's sd, in sds, times sqrt(n)."""


def regression_axis(steps: np.ndarray, first: int = 0) -> tuple[np.ndarray, str]:
    """What growth is regressed on: the step numbers where they rise through ``steps``, else each
    collect's place (``first``, ``first + 1``, ...): steps numbered per epoch would turn a leak into a
    saw tooth."""
    s = np.asarray(steps)
    if s.size < 2 or bool((np.diff(s) > 0).all()):
        return s, "step"
    return np.arange(first, first + s.size, dtype=np.int64), "collect"


def _window(n: int, config: LeakConfig) -> int:
    """How many of the last ``n`` points to examine."""
    if config.last is not None:
        return min(n, config.last)
    return max(int(math.ceil(n * config.window)), min(n, config.min_steps))


def _trend_columns(x: np.ndarray, y: np.ndarray, key: str, ranks: Sequence[int], config: LeakConfig,
                   stakes: np.ndarray, depth: int = 0) -> list[Trend | None]:
    """The verdicts for the columns of ``y`` (MiB, no gaps; column c is rank ``ranks[c]``, its stakes
    floor ``stakes[c]`` MiB) against the shared steps ``x``, in one numpy pass: the pairwise work is
    what costs, and it vectorises across ranks."""
    take = _window(x.size, config)
    if take < config.min_steps:
        return [None] * len(ranks)
    x, y = x[-take:], y[-take:]
    xb, yb = block_medians(x, y, config.max_points)
    rows = np.ascontiguousarray(yb.T)
    dy = pair_differences(rows)
    var = tie_variance(rows)
    slope, low, high = sen(pair_differences(xb.reshape(1, -1))[0], dy, var, 0.95)
    p = np.array([upper_p(float(s), float(v)) for s, v in zip(np.sign(dy).sum(axis=1), var, strict=True)])
    span = float(x[-1] - x[0])
    growth = slope * span
    noise = np.maximum(robust_sd(y - slope * x[:, None]), step_sd(y))
    # A short window can underestimate the noise: take the upper 95% bound of the MAD estimate
    # (its standard error is ~1.17 sd / sqrt(n)), so that re-testing short windows online stays quiet.
    noise *= 1.0 + _NORMAL_95 * _MAD_SE / math.sqrt(take)
    bar = config.noise_factor * noise + stakes
    # A leak never gives memory back; a cache that fills and empties (a sawtooth) does.
    smooth = running_median(y, _DRAWDOWN_WIDTH)
    drawdown = (np.maximum.accumulate(smooth, axis=0) - smooth).max(axis=0)
    clear = (slope > 0) & (p < config.alpha)
    grows = clear & (growth >= bar) & (drawdown <= 0.5 * growth)
    reasons = [""] * len(ranks)
    for c in np.flatnonzero(clear & ~grows).tolist():
        if growth[c] < bar[c]:
            reasons[c] = (f"growth {growth[c]:+.1f} MiB is under the bar of {bar[c]:.1f} MiB "
                          f"({config.noise_factor:g} x {noise[c]:.1f} MiB noise + {stakes[c]:.1f} MiB at stake)")
        else:
            reasons[c] = f"gives back {drawdown[c]:.1f} MiB of its {growth[c]:+.1f} MiB growth (fills and empties)"
    stories = [""] * len(ranks)
    for c in np.flatnonzero(grows).tolist():  # only would-be leaks pay for the shape check
        stories[c], why = _shape(x, y[:, c], key, config, float(stakes[c]), depth)
        if why:
            grows[c] = False
            reasons[c] = why
    out: list[Trend | None] = []
    for c, rank in enumerate(ranks):
        if math.isnan(slope[c]):
            out.append(None)
            continue
        out.append(Trend(
            key=key, rank=rank, first_step=int(x[0]), last_step=int(x[-1]), n=int(take),
            slope_mib=float(slope[c]), low_mib=float(low[c]), high_mib=float(high[c]), p_value=float(p[c]),
            growth_mib=float(growth[c]), noise_mib=float(noise[c]), bar_mib=float(bar[c]),
            drawdown_mib=float(drawdown[c]), leak=bool(grows[c]), reason=reasons[c], story=stories[c],
        ))
    return out


def _shape(x: np.ndarray, y: np.ndarray, key: str, config: LeakConfig, stakes: float,
           depth: int) -> tuple[str, str]:
    """(story, why not): what one would-be leak's window did, in words ("grew +140.0 MiB from step 81
    to 150, then held"), and why it is no leak ("" when it is one). ``x, y``: the window (MiB).

    Read on smoothed block medians, two shapes are not leaks: growth that ended and held for longer than it
    took, and growth carried by the largest 1-3 jumps (``_JUMPS_SHARE``); the part after the largest jump is
    then judged again, so a leak that starts after one is flagged.
    """
    xb, yb = block_medians(x, y[:, None], config.max_points)
    n = yb.shape[0]
    width = min(_DRAWDOWN_WIDTH, n // 8)
    width = max(width - 1 + width % 2, 1)  # odd, and narrow on short windows (a few refreshes)
    smooth = running_median(yb, width)[:, 0]
    ends = width // 2 + 1  # the ends' running medians see fewer points: a median of them steadies them
    low, high = float(np.median(smooth[:ends])), float(np.median(smooth[-ends:]))
    rise = high - low
    if rise <= 0:
        return "", "no rise across the window once one-step spikes are dropped"
    start = int(np.flatnonzero(smooth <= low + 0.05 * rise)[-1])
    top = start + int(np.argmax(smooth[start:] >= low + 0.95 * rise))
    grew, held = float(xb[top] - xb[start]), float(xb[-1] - xb[top])
    story = f"grew {rise:+.1f} MiB from step {int(xb[start])} to {int(xb[top])}"
    flat = held > 0.1 * (grew + held) and n - 1 - top >= 3  # noise moves the top a point or two
    story += f", then held to {int(xb[-1])}" if flat else ", still growing"
    if held > grew:
        return story, f"{story}: held for longer than it grew (a warm-up or a cache that filled)"
    # The rise over each span of the smoothing width (a jump spreads over about that many points of the
    # running median); a jump is a span that rises more than a ramp's spans do, by more than their noise.
    spans = smooth[width:] - smooth[:-width] if n > width else np.array([rise])
    excess = spans - float(np.median(spans))
    # The spans' own noise: that of a running median's difference, from the step-to-step noise (robust to
    # the jumps themselves, which a spread of the spans is not).
    white = float(step_sd(yb)[0])
    tall = _JUMP_SD * white * math.sqrt(math.pi / width)
    # The largest few that do not overlap: as many as keep a ramp's share of its rise in them under a quarter.
    count, free = min(max(n // (4 * width), 1), _MAX_JUMPS), excess.copy()
    largest: list[int] = []
    while len(largest) < count and free.size and float(free.max()) > tall:
        i = int(np.argmax(free))
        largest.append(i)
        free[max(i - width + 1, 0) : i + width] = -np.inf
    if float(excess[largest].sum()) <= _JUMPS_SHARE * rise:
        return story, ""
    at = float(xb[largest[0] + width])
    after = x >= at
    if depth < _MAX_DEPTH and after.sum() >= config.min_steps:
        # Is what follows the largest jump a leak of its own? Judged whole, by the same rules.
        whole = replace(config, window=1.0, last=None)
        again = _trend_columns(x[after], y[after, None], key, [0], whole, np.array([stakes]), depth + 1)[0]
        if again is not None and again.leak:
            return again.story, ""
    jumps = ", ".join(f"{excess[i]:+.1f} MiB by step {int(xb[i + width])}" for i in sorted(largest))
    return story, (f"{story}, mostly in {len(largest)} jump(s) ({jumps}): growth at a few steps, "
                   "not spread over them")


def refreshes(values: np.ndarray) -> np.ndarray:
    """Where a refreshed figure was read anew: its first finite value and each that differs from the
    finite value before it (nan elsewhere, each column of ``values`` on its own)."""
    out = np.full(values.shape, np.nan)
    for c in range(values.shape[1]):
        ok = np.flatnonzero(np.isfinite(values[:, c]))
        v = values[ok, c]
        keep = ok[np.concatenate([[True], v[1:] != v[:-1]])] if ok.size else ok
        out[keep, c] = values[keep, c]
    return out


def trend(steps: np.ndarray, values_gib: np.ndarray, key: str, rank: int, config: LeakConfig | None = None,
          capacity_gib: float | None = None) -> Trend | None:
    """The verdict for one series (GiB values against step numbers); None when too short to judge.
    ``capacity_gib``: what the series grows into (see :attr:`LeakConfig.capacity_fraction`)."""
    config = config or LeakConfig()
    values = np.asarray(values_gib, dtype=float)
    ok = np.isfinite(values)
    if key in REFRESHED_KEYS:  # the window is the steps', judged on the refreshes inside it
        take = _window(int(ok.sum()), config)
        if take < config.min_steps:
            return None
        read = np.flatnonzero(np.isfinite(refreshes(values[:, None])[:, 0]))
        # The steps' window, widened back to the last few refreshes where it holds fewer: a figure read
        # every 0.5 s under 10 ms steps refreshes every ~22 steps, 3-4 times in the last half of 160.
        start = min(np.flatnonzero(ok)[-take], read[-min(_MIN_REFRESHES, read.size)]) if read.size else 0
        where = np.flatnonzero(ok[start:]) + start
        values = refreshes(values[where, None])[:, 0]
        steps, ok = np.asarray(steps)[where], np.isfinite(values)
        config = replace(config, window=1.0, last=None, min_steps=min(config.min_steps, _MIN_REFRESHES))
    x = np.asarray(steps, dtype=float)[ok]
    stakes = np.array([config.stakes_mib(capacity_gib)])
    return _trend_columns(x, values[ok, None] * MIB_PER_GIB, key, [rank], config, stakes)[0]


# Ranks judged in one pass: 64 ranks x 32k pairs keeps the pairwise arrays near 17 MB each.
_BATCH = 64


def trends(steps: np.ndarray, columns_gib: np.ndarray, key: str, ranks: Sequence[int], config: LeakConfig,
           capacity_gib: Sequence[float | None] | None = None) -> list[Trend]:
    """Trends of the columns of ``columns_gib`` (steps x series; column c is rank ``ranks[c]``, growing
    into ``capacity_gib[c]``), by rank.

    Columns without gaps share their steps and are judged together; a column with gaps has its own
    window and is judged alone; an empty one (a key this rank never reported) is skipped."""
    finite = np.isfinite(columns_gib)
    caps = list(capacity_gib) if capacity_gib is not None else [None] * len(ranks)
    stakes = np.array([config.stakes_mib(c) for c in caps])
    whole = [c for c in range(len(ranks)) if finite[:, c].all() and key not in REFRESHED_KEYS]
    x = np.asarray(steps, dtype=float)
    out: list[Trend | None] = []
    for start in range(0, len(whole), _BATCH):
        cols = whole[start : start + _BATCH]
        out += _trend_columns(x, columns_gib[:, cols] * MIB_PER_GIB, key, [ranks[c] for c in cols], config,
                              stakes[cols])
    for c in range(len(ranks)):
        if finite[:, c].any() and c not in whole:
            out.append(trend(steps, columns_gib[:, c], key, ranks[c], config, caps[c]))
    return sorted((t for t in out if t is not None), key=lambda t: t.rank)


# ---- a flagged series in its context ----------------------------------------------------------------

def outlook(found: Sequence[Trend], current_gib: Callable[[Trend], float | None],
            context: Callable[[int], Mapping[str, float | None]], node_of: Callable[[int], object],
            pace: float | None, phase_deltas: Callable[[Trend], Mapping[str, np.ndarray]],
            also_leaking: Sequence[Trend] = ()) -> list[Trend]:
    """``found`` with each leak's phase and exhaustion filled in (other trends unchanged).

    ``current_gib(t)``: the series' value at ``t.last_step``; ``context(rank)``: that rank's latest
    capacity figures by key; ``node_of(rank)``: its node; ``pace``: seconds per step; ``phase_deltas(t)``:
    per phase, the delta key's values over ``t``'s window; ``also_leaking``: leaks found before, which draw
    on their node's host memory too.
    """
    node_rate: dict[object, float] = {}
    for t in [*found, *also_leaking]:
        if t.leak and not _outlook.is_device_key(t.key):
            node = node_of(t.rank)
            node_rate[node] = node_rate.get(node, 0.0) + t.slope_mib
    out = []
    for t in found:
        if not t.leak:
            out.append(t)
            continue
        phase = _outlook.leaking_phase(phase_deltas(t), t.growth_mib) if t.key in PHASE_DELTA else None
        projection = None
        current = current_gib(t)
        room = None if current is None else _outlook.headroom_gib(t.key, context(t.rank), current)
        if room is not None:
            rate = t.slope_mib if _outlook.is_device_key(t.key) else node_rate[node_of(t.rank)]
            projection = _outlook.exhaustion(room[0], room[1], rate, t.last_step, pace)
        out.append(replace(t, phase=phase, exhaustion=projection))
    return out


def phase_delta_keys(key: str, keys: Sequence[str]) -> dict[str, str]:
    """Phase name -> its delta key of ``key`` (``mem/phase/P/rss_delta_gib`` for host RSS) among ``keys``."""
    suffix = PHASE_DELTA.get(key)
    if suffix is None:
        return {}
    tail = "/" + suffix
    return {k[len(PHASE_PREFIX) : -len(tail)]: k for k in keys if k.startswith(PHASE_PREFIX) and k.endswith(tail)}


# ---- online ----------------------------------------------------------------------------------------



