"""From a run's windows to advice: the largest micro-batch per phase and rank whose predicted peak fits.

The memory model per phase and rank (:mod:`rankmem.fit.series`) and the capacity and verdict
(:mod:`rankmem.fit.capacity`) have one owner, shared with the online warning; this module reads them off
a run log. The host's fit needs each window's peak to be its own: glibc keeps freed blocks, so the
reference worker's token-budget jobs fix the mmap threshold and hand the freed heap back after each
step (:mod:`rankmem.engine.hostheap`; docs/advice.md says why and how to do it in a job of your own).
Offline code: numpy, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from rankmem.core.catalogue import key_of, work_key
from rankmem.errors import RankmemError
from rankmem.fit import capacity
from rankmem.fit import series as fitseries
from rankmem.fit.capacity import Assessment, Limit
from rankmem.fit.model import FitConfig, NoFit
from rankmem.fit.series import PhaseFit
from rankmem.offline import Run
from rankmem.trend.trend import LeakConfig, Trend, regression_axis, trend

EXTRAPOLATION = 1.5
"""The model is trusted up to this multiple of the largest T seen; past it, a step there must be run first."""


def memory_kind(run: Run, phase: str) -> str:
    """``device`` where the phase has device peaks, else ``host``."""
    return fitseries.memory_kind(run.series, phase)


def work_phases(run: Run) -> list[str]:
    """The phases whose micro-batches were told (they carry a heaviest micro-batch's tokens)."""
    return [p for p in run.phases() if work_key(p, "mb_tokens") in run.series]


def fit_ranks(run: Run, phase: str, warmup: int, config: FitConfig | None = None,
              kind: str | None = None) -> list[PhaseFit]:
    """Every rank's fit of one phase (:func:`rankmem.fit.series.fit_ranks` on the run's arrays)."""
    return fitseries.fit_ranks(run.series, run.steps, phase, warmup, config, kind)


def run_limit(run: Run, kind: str, cap: float | None = None, headroom: float | None = None) -> Limit:
    """The run's limit per rank (:func:`rankmem.fit.capacity.limit`), its errors naming the run."""
    try:
        return capacity.limit(run.series, _hosts(run), kind, cap, headroom)
    except RankmemError as exc:
        raise RankmemError(str(exc).replace("the run", run.path, 1)) from None


def assess(run: Run, warmup: int = 2) -> Assessment:
    """The run's limit and verdicts (:func:`rankmem.fit.capacity.assess`) for report, watch and the page."""
    return capacity.assess(run.series, run.steps, _hosts(run), warmup)


def _hosts(run: Run) -> list[str]:
    return [r.host or "?" for r in run.header.ranks]


def baseline_growth(run: Run, rank: int, warmup: int, kind: str, capacity_gib: float | None = None) -> Trend | None:
    """Growth of what ``rank`` holds between steps after warm-up (RSS on the host, allocated on the
    device): the trend where the leak test, over every step after warm-up, calls it growth, else None (also
    where the step numbers do not rise). A run that goes on growing needs that growth free too, which
    ``rankmem advise --steps`` keeps.
    """
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
