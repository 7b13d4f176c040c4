"""From a phase's windows to what the fit takes, and back to a peak against capacity: one owner for
``rankmem advise``, ``report``, ``watch`` and the online warning.

Over a mapping of key -> (steps x ranks) GiB (the run log's arrays, or the online watch's history),
per phase and rank after warm-up: ``rise = peak - baseline`` against the heaviest micro-batch's tokens
T (and sum of squared lengths Q).

- **host**: peak = the phase's peak RSS, baseline = the lowest RSS between steps, one figure;
- **device**: peak = the phase's peak allocated, baseline = the step's allocated at its end; against
  capacity the latest baseline (the median of the last :data:`BASELINE_STEPS`) plus the rise is scaled
  by the allocator's overhead (:func:`rankmem.fit.overhead.overhead_ratio`) and the memory outside torch
  (``other``, the most seen) is added.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from rankmem.core.catalogue import key_of, phase_key, work_key
from rankmem.core.scalars import WORK_MAX
from rankmem.errors import RankmemError
from rankmem.fit.held import HELD_PARTS, held_state
from rankmem.fit.model import Fit, FitConfig, NoFit
from rankmem.fit.overhead import grew_pool, overhead_ratio
from rankmem.fit.pooled import fit_phase

BASELINE_STEPS = 5
"""The device baseline is the median of the allocated at the end of this many latest steps."""


@dataclass(frozen=True)
class PhaseFit:
    """One phase of one rank: the fit (or why none) and what turns a rise into a peak against capacity."""

    phase: str
    rank: int
    model: Fit | NoFit
    baseline: float
    """GiB: the lowest resident memory between steps (host), or the latest allocated (device)."""
    extra: float
    """GiB added before comparing with capacity: the memory outside torch (device)."""
    sq_max: float
    """The largest Q seen (0 if not told): its square root bounds the longest sequence seen."""
    tokens_seen: np.ndarray
    baseline_step: float = math.nan
    """The step the predicted peak's baseline stands for. Host: the mean step of the fitted windows (their
    rises are over the run's lowest RSS, so a growing baseline's average is in the fit). Device: the
    median step of the last steps whose allocated is the baseline."""
    overhead_ratio: float = 1.0
    """Device: the allocator's reserved over allocated at the phase's peak
    (:func:`rankmem.fit.overhead.overhead_ratio`); the predicted allocation is scaled by it. Host: 1."""

    def peak(self, tokens: float, sq_tokens: float | None = None) -> tuple[float, float, float]:
        """(peak, low, high) in GiB, as set against capacity: (baseline + rise) x the allocator's ratio
        + the memory outside torch."""
        assert isinstance(self.model, Fit)
        rise, low, high = self.model.predict(tokens, sq_tokens)
        r, base = self.overhead_ratio, self.baseline
        return (base + rise) * r + self.extra, (base + low) * r + self.extra, (base + high) * r + self.extra


Series = Mapping[str, np.ndarray]


def memory_kind(series: Series, phase: str) -> str:
    """``device`` where the phase has device peaks, else ``host``."""
    return "device" if phase_key(phase, "peak_allocated_gib") in series else "host"


def fit_ranks(series: Series, steps: np.ndarray, phase: str, warmup: int, config: FitConfig | None = None,
              kind: str | None = None) -> list[PhaseFit]:
    """Every rank's fit of one phase, the Q term decided and the shared coefficients fitted once on all
    ranks' windows (:func:`rankmem.fit.pooled.fit_phase`)."""
    kind = kind or memory_kind(series, phase)
    world = series[work_key(phase, "mb_tokens")].shape[1]
    rows = slice(min(warmup, steps.size), None)
    found = [_phase_series(series, steps, phase, rank, rows, kind) for rank in range(world)]
    models = fit_phase([(t, rise, q) for _, t, rise, q in found], config)
    return [replace(pf, model=m) for (pf, *_), m in zip(found, models, strict=True)]


def _phase_series(series: Series, steps: np.ndarray, phase: str, rank: int, rows: slice, kind: str
                  ) -> tuple[PhaseFit, np.ndarray, np.ndarray, np.ndarray | None]:
    """One rank's windows after warm-up as the fit takes them (T, rise, Q), with what turns a fitted
    rise into a peak (the model is filled in once every rank's is fitted)."""
    col = _col(series, work_key(phase, "mb_tokens"), rank, rows)
    q_key = work_key(phase, "mb_sq_tokens")
    q = _col(series, q_key, rank, rows) if q_key in series else None
    # Peak anatomy (Monitor.track): the rise less the gradients and optimizer state present at the peak;
    # the baseline holds them instead.
    held, static = held_state(*(_col(series, k, rank, rows) if k in series else None for k in
                                (phase_key(phase, f"anatomy/{p}_gib") for p in HELD_PARTS)))
    if kind == "device":
        peak = _col(series, phase_key(phase, "peak_allocated_gib"), rank, rows)
        base = _col(series, key_of("allocated"), rank, rows)
        ratio = _allocator_ratio(series, phase, rank, rows, peak)
        other = _col(series, key_of("other"), rank, rows) if key_of("other") in series else np.zeros(0)
        finite = base[np.isfinite(base)]
        baseline = float(np.median(finite[-BASELINE_STEPS:])) if finite.size else math.nan
        seen = steps[rows][np.isfinite(base)]
        at = float(np.median(seen[-BASELINE_STEPS:])) if seen.size else math.nan
        rise, extra = peak - base - held, _nanmax(other)
    else:
        peak = _col(series, phase_key(phase, "peak_rss_gib"), rank, rows)
        base = _col(series, key_of("rss"), rank, rows)
        baseline = float(np.nanmin(base)) if np.isfinite(base).any() else math.nan
        fitted = steps[rows][np.isfinite(col) & np.isfinite(peak)]
        at = float(np.mean(fitted)) if fitted.size else math.nan
        rise, extra, ratio = peak - baseline - held, 0.0, 1.0
    sq_max = float(np.nanmax(q)) if q is not None and np.isfinite(q).any() else 0.0
    pf = PhaseFit(phase, rank, NoFit("", "not fitted"), baseline + static, extra, sq_max, col[np.isfinite(col)], at,
                  ratio)
    return pf, col, rise, q


def _allocator_ratio(series: Series, phase: str, rank: int, rows: slice, peak: np.ndarray) -> float:
    """The phase's peak reserved over its peak allocated where its windows grew the allocator's pool
    (:func:`rankmem.fit.overhead.overhead_ratio`; the windows before ``rows`` count for the growth)."""
    reserved_all = series.get(phase_key(phase, "peak_reserved_gib"))
    if reserved_all is None:
        return 1.0
    reserved_all = np.asarray(reserved_all[:, rank], dtype=np.float64)
    reserved = reserved_all[rows]
    rise = series.get(phase_key(phase, "peak_reserved_rise_gib"))
    if rise is not None and np.isfinite(rise[rows, rank]).any():
        grew = grew_pool(reserved, peak, np.asarray(rise[rows, rank], dtype=np.float64))
    else:  # an older log: the pool at a window's start is the largest reserved peak before it
        ahead = reserved_all[: rows.start or 0]
        before = float(np.nanmax(ahead)) if np.isfinite(ahead).any() else -np.inf
        grew = grew_pool(reserved, peak, None, before)
    return overhead_ratio(peak, reserved, grew)


def _bound(key: str) -> float:
    # A figure past any machine (a PiB) or any micro-batch (2**40 tokens, its square for Q) is an overflowed
    # counter or a corrupt record: the window is left out of the fit, which squares what it is given.
    return 2.0**20 if key.endswith("_gib") else WORK_MAX**2 if key.endswith("sq_tokens") else WORK_MAX


def _col(series: Series, key: str, rank: int, rows: slice) -> np.ndarray:
    matrix = series.get(key)
    if matrix is None:
        raise RankmemError(f"the run has no {key}: it did not measure it")
    values = np.asarray(matrix[rows, rank], dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return np.where(np.abs(values) <= _bound(key), values, np.nan)


def left_out(series: Series, steps: np.ndarray, phase: str, warmup: int, kind: str | None = None) -> list[str]:
    """The phase's windows after warm-up that the fit leaves out, one line each: a figure past its bound,
    or a peak with no work counted (``micro_batch`` refused the count, or was not called)."""
    kind = kind or memory_kind(series, phase)
    peak, base = (("peak_allocated_gib", "allocated") if kind == "device" else ("peak_rss_gib", "rss"))
    keys = [work_key(phase, "mb_tokens"), work_key(phase, "mb_sq_tokens"), phase_key(phase, peak), key_of(base)]
    cube = {k: np.asarray(series[k], dtype=np.float64)[warmup:] for k in keys if k in series}
    found = []
    with np.errstate(invalid="ignore"):
        for key, values in cube.items():
            found += [(r, k, f"{key} = {values[r, k]:.4g}, past any real figure")
                      for r, k in np.argwhere(np.abs(values) > _bound(key)).tolist()]
        if keys[0] in cube and keys[2] in cube:
            found += [(r, k, "its work was not counted (micro_batch refused it or was not called)")
                      for r, k in np.argwhere(np.isnan(cube[keys[0]]) & np.isfinite(cube[keys[2]])).tolist()]
    return [f"step {int(steps[warmup + r])} rank {k}: {why}" for r, k, why in sorted(found)]


def _nanmax(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(max(finite.max(), 0.0)) if finite.size else 0.0
