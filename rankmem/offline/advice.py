"""From a run's windows to advice: the memory model per phase and rank, and the largest micro-batch that fits.

For each phase told its micro-batches (``Monitor.micro_batch``) and each rank, the windows after
warm-up give ``rise = peak - baseline`` against the heaviest micro-batch's tokens T (and sum of squared
lengths Q), fitted by :func:`rankmem.fit.fit_memory`:

- **host** (no device keys): peak = the phase's peak RSS, baseline = the lowest RSS between steps after
  warm-up, one figure for the run. That needs each window's peak to be its own: glibc keeps freed blocks
  (its mmap threshold grows; small blocks stay in the heap's free lists), so the reference worker's
  token-budget jobs fix the mmap threshold and hand the freed heap back after each step
  (:mod:`rankmem.engine.hostheap`; docs/advice.md says why and how to do it in a job of your own);
- **device**: peak = the phase's peak allocated, baseline = the step's allocated at its end; set
  against capacity, the predicted allocation is scaled by the allocator's overhead (the phase's peak
  reserved over peak allocated, in the windows that grew the allocator's pool:
  :func:`rankmem.fit.overhead_ratio`) and the memory outside torch (``other``, the largest seen after
  warm-up) is added.

The peak set against capacity is the latest baseline (median of the last few steps) plus the rise.
Offline code: numpy, no torch.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

from rankmem.core.catalogue import key_of, phase_key, work_key
from rankmem.core.scalars import WORK_MAX
from rankmem.errors import RankmemError
from rankmem.fit import Fit, FitConfig, NoFit, fit_phase, grew_pool, overhead_ratio
from rankmem.offline import Run
from rankmem.offline.capacity import capacities
from rankmem.trend.trend import LeakConfig, Trend, regression_axis, trend

EXTRAPOLATION = 1.5
"""The model is trusted up to this multiple of the largest T seen; past it, a step there must be run first."""
BASELINE_STEPS = 5


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
    """Device: the allocator's reserved over allocated at the phase's peak (:func:`rankmem.fit.overhead_ratio`);
    the predicted allocation is scaled by it. Host: 1."""

    def peak(self, tokens: float, sq_tokens: float | None = None) -> tuple[float, float, float]:
        """(peak, low, high) in GiB, as set against capacity: (baseline + rise) x the allocator's ratio
        + the memory outside torch."""
        assert isinstance(self.model, Fit)
        rise, low, high = self.model.predict(tokens, sq_tokens)
        r, base = self.overhead_ratio, self.baseline
        return (base + rise) * r + self.extra, (base + low) * r + self.extra, (base + high) * r + self.extra


def memory_kind(run: Run, phase: str) -> str:
    """``device`` where the phase has device peaks, else ``host``."""
    return "device" if phase_key(phase, "peak_allocated_gib") in run.series else "host"


def work_phases(run: Run) -> list[str]:
    """The phases whose micro-batches were told (they carry a heaviest micro-batch's tokens)."""
    return [p for p in run.phases() if work_key(p, "mb_tokens") in run.series]


def fit_ranks(run: Run, phase: str, warmup: int, config: FitConfig | None = None,
              kind: str | None = None) -> list[PhaseFit]:
    """Every rank's fit of one phase, the Q term decided and the shared coefficients fitted once on all
    ranks' windows (:func:`rankmem.fit.fit_phase`)."""
    kind = kind or memory_kind(run, phase)
    series = [_phase_series(run, phase, rank, warmup, kind) for rank in range(run.world_size)]
    models = fit_phase([(s.tokens, s.rise, s.sq) for s in series], config)
    return [_phase_fit(phase, rank, s, m) for rank, (s, m) in enumerate(zip(series, models, strict=True))]


@dataclass(frozen=True)
class _Series:
    """One rank's windows of one phase after warm-up, as the fit takes them."""

    tokens: np.ndarray
    rise: np.ndarray
    sq: np.ndarray | None
    baseline: float
    extra: float
    baseline_step: float
    ratio: float = 1.0


def _phase_series(run: Run, phase: str, rank: int, warmup: int, kind: str) -> _Series:
    rows = slice(min(warmup, run.steps.size), None)
    col = _col(run, work_key(phase, "mb_tokens"), rank, rows)
    q_key = work_key(phase, "mb_sq_tokens")
    q = _col(run, q_key, rank, rows) if q_key in run.series else None
    if kind == "device":
        peak = _col(run, phase_key(phase, "peak_allocated_gib"), rank, rows)
        base = _col(run, key_of("allocated"), rank, rows)
        ratio = _allocator_ratio(run, phase, rank, rows, peak)
        other = _col(run, key_of("other"), rank, rows) if key_of("other") in run.series else np.zeros_like(peak)
        finite = base[np.isfinite(base)]
        baseline = float(np.median(finite[-BASELINE_STEPS:])) if finite.size else math.nan
        seen = run.steps[rows][np.isfinite(base)]
        at = float(np.median(seen[-BASELINE_STEPS:])) if seen.size else math.nan
        return _Series(col, peak - base, q, baseline, _nanmax(other), at, ratio)
    peak = _col(run, phase_key(phase, "peak_rss_gib"), rank, rows)
    base = _col(run, key_of("rss"), rank, rows)
    baseline = float(np.nanmin(base)) if np.isfinite(base).any() else math.nan
    fitted = run.steps[rows][np.isfinite(col) & np.isfinite(peak)]
    at = float(np.mean(fitted)) if fitted.size else math.nan
    return _Series(col, peak - baseline, q, baseline, 0.0, at)


def _allocator_ratio(run: Run, phase: str, rank: int, rows: slice, peak: np.ndarray) -> float:
    """The phase's peak reserved over its peak allocated where its windows grew the allocator's pool
    (:func:`rankmem.fit.overhead_ratio`; the windows before ``rows`` count for the growth)."""
    reserved_all = run.series.get(phase_key(phase, "peak_reserved_gib"))
    if reserved_all is None:
        return 1.0
    reserved_all = np.asarray(reserved_all[:, rank], dtype=np.float64)
    reserved = reserved_all[rows]
    rise_key = phase_key(phase, "peak_reserved_rise_gib")
    if rise_key in run.series:
        grew = grew_pool(reserved, peak, _col(run, rise_key, rank, rows))
    else:  # an older log: the pool at a window's start is the largest reserved peak before it
        ahead = reserved_all[: rows.start or 0]
        grew = grew_pool(reserved, peak, None, float(np.nanmax(ahead)) if np.isfinite(ahead).any() else -np.inf)
    return overhead_ratio(peak, reserved, grew)


def _phase_fit(phase: str, rank: int, s: _Series, model: Fit | NoFit) -> PhaseFit:
    sq_max = float(np.nanmax(s.sq)) if s.sq is not None and np.isfinite(s.sq).any() else 0.0
    return PhaseFit(phase, rank, model, s.baseline, s.extra, sq_max, s.tokens[np.isfinite(s.tokens)], s.baseline_step,
                    s.ratio)


def baseline_growth(run: Run, rank: int, warmup: int, kind: str, capacity_gib: float | None = None) -> Trend | None:
    """Growth of what ``rank`` holds between steps after warm-up (RSS on the host, allocated on the
    device): the trend where the leak test (``rankmem leaks``' statistics and bar, against
    ``capacity_gib``, over every step after warm-up rather than the run's second half) calls it growth,
    else None; None too where the step numbers do not rise (per-epoch numbering), which leaves no step
    to project to. The fit takes the baseline as it was seen; a run that goes on growing needs that
    growth free too, which ``rankmem advise --steps`` keeps."""
    key = key_of("allocated") if kind == "device" else key_of("rss")
    series = run.series.get(key)
    rows = slice(min(warmup, run.steps.size), None)
    steps = run.steps[rows]
    if series is None or regression_axis(steps)[1] != "step":
        return None
    found = trend(steps, series[rows, rank], key, rank, LeakConfig(window=1.0), capacity_gib)
    return found if found is not None and found.leak and found.slope_mib > 0 else None


def growth_ahead_gib(pf: PhaseFit, growth: Trend, until_step: int) -> float:
    """GiB the growth adds to the predicted peak by step ``until_step``: from the step the prediction's
    baseline stands for (:attr:`PhaseFit.baseline_step`), not from the run's last."""
    return max(until_step - pf.baseline_step, 0.0) * growth.slope_mib / 1024


def _col(run: Run, key: str, rank: int, rows: slice) -> np.ndarray:
    matrix = run.series.get(key)
    if matrix is None:
        raise RankmemError(f"{run.path} has no {key}: the run did not measure it")
    values = np.asarray(matrix[rows, rank], dtype=np.float64)
    # A figure past any machine (a PiB) or any micro-batch (2**40 tokens, its square for Q) is an overflowed
    # counter or a corrupt record: the window is left out of the fit, which squares what it is given.
    bound = 2.0**20 if key.endswith("_gib") else WORK_MAX**2 if key.endswith("sq_tokens") else WORK_MAX
    with np.errstate(invalid="ignore"):
        return np.where(np.abs(values) <= bound, values, np.nan)


def _nanmax(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(max(finite.max(), 0.0)) if finite.size else 0.0


@dataclass(frozen=True)
class Limit:
    """The memory each rank may use: capacity (and where it comes from) and the headroom kept."""

    capacity: float
    source: str
    headroom: float

    @property
    def usable(self) -> float:
        return self.capacity - self.headroom


def run_capacity(run: Run, kind: str) -> tuple[float, str]:
    """The capacity the run log says, per rank: the device total; on the host the cgroup limit or the
    node's total memory, less what the node's other processes held there (the launcher, torchrun's agent,
    dataloader workers, anything else: the most seen, used minus the ranks' RSS), shared by the ranks on
    the node (the tightest node binds)."""
    caps = {c.label: c.value for c in capacities(run)}
    if kind == "device":
        if "device total" in caps:
            return caps["device total"], "device total"
        raise RankmemError(f"{run.path} has no device total: pass --capacity GIB")
    cgroup = "cgroup limit" in caps
    label = "cgroup limit" if cgroup else "node total"
    if label not in caps:
        raise RankmemError(f"{run.path} has neither a cgroup limit nor the node's memory: pass --capacity GIB")
    used = _node_used(run, cgroup)
    rss = run.series.get(key_of("rss"))
    hosts = [r.host or "?" for r in run.header.ranks]
    best: tuple[float, float, int] | None = None
    for host in sorted(set(hosts)):
        ranks = [k for k, h in enumerate(hosts) if h == host]
        other = _others(used, rss, ranks)
        per_rank = (caps[label] - other) / len(ranks)
        if best is None or per_rank < best[0]:
            best = (per_rank, other, len(ranks))
    assert best is not None
    per_rank, other, share = best
    said = label + (f" less {other:.3f} GiB of other processes" if other > 0 else "")
    return per_rank, said + (f" / {share} ranks" if share > 1 else "")


def _node_used(run: Run, cgroup: bool) -> np.ndarray | None:
    """What the node (or the cgroup: its working set, else its usage) had in use, per step and rank."""
    keys = ("cgroup_working_set", "cgroup_used") if cgroup else ("node_used",)
    for name in keys:
        matrix = run.series.get(key_of(name))
        if matrix is not None and np.isfinite(matrix).any():
            return np.asarray(matrix, dtype=np.float64)
    return None


def _others(used: np.ndarray | None, rss: np.ndarray | None, ranks: list[int]) -> float:
    """GiB the node's other processes held at most: its use (the same figure on each of its ranks) minus
    its ranks' RSS; 0 where either is missing. A rank's file pages the node did not charge to it make
    this smaller, not larger: it is the part of the limit the ranks' RSS cannot have."""
    if used is None or rss is None:
        return 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a step no rank reported: nan
        node = np.nanmedian(used[:, ranks], axis=1)
    return _nanmax(node - np.sum(rss[:, ranks], axis=1))


@dataclass(frozen=True)
class Advice:
    """The largest heaviest-micro-batch tokens of one phase on one rank whose predicted peak fits."""

    phase: str
    rank: int
    max_tokens: int
    """Where the interval's high end reaches capacity minus headroom (capped at 1.5x the largest T seen)."""
    point_tokens: int
    """Where the predicted peak itself reaches it (the interval's other side: where its low end does)."""
    low_tokens: int
    high_tokens: int
    capped: bool
    """The fit would allow more than 1.5x the largest T seen: run a step near :attr:`cap` to go further."""
    cap: int
    predicted_peak_gib: float
    high_gib: float


def advise_rank(pf: PhaseFit, limit: Limit) -> Advice | str:
    """The advice for one phase and rank, or why there is none."""
    if isinstance(pf.model, NoFit):
        return pf.model.reason
    fit = pf.model
    cap = EXTRAPOLATION * fit.t_max

    def reach(which: int) -> float:  # the T at which peak()[which] reaches the usable memory
        if pf.peak(0.0)[which] > limit.usable:
            return 0.0
        if pf.peak(cap)[which] <= limit.usable:
            return cap
        lo, hi = 0.0, cap
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if pf.peak(mid)[which] <= limit.usable else (lo, mid)
        return lo

    safe, point, loose = reach(2), reach(0), reach(1)
    if safe <= 0:
        return (f"the baseline alone ({pf.peak(0.0)[2]:.2f} GiB with the interval) is over capacity minus headroom "
                f"({limit.usable:.2f} GiB): no micro-batch fits")
    peak, _, high = pf.peak(safe)
    return Advice(pf.phase, pf.rank, int(safe), int(point), int(safe), int(loose), safe >= cap, int(cap), peak, high)
