"""Rank imbalance explained: how much of a rank's excess peak its tokens account for, and the rest.

Per phase told its micro-batches and per rank, over the steps after warm-up: the rank's excess is the
mean over steps of its phase peak minus the median of the other ranks that step; the part its tokens explain is
the rise per token (the median over ranks of each rank's fitted :meth:`rankmem.fit.model.Fit.per_token`,
fitted on that rank's own variation over time) times its tokens' excess over the others the same way.
The rest (an inference engine, a driver's duty, a leak, a buffer) is unexplained; a rank is flagged
when that is over ``max(fraction x the mean peak rise, floor)`` (:class:`ImbalanceConfig`). A rank under
that threshold whose unexplained part still stands clear of the noise (over ``NOTE_SIGMAS`` times the
spread of its step-by-step unexplained part, itself at least the fit's residual scale) is noted with its
figure: a 200 MiB buffer under a 256 MiB floor is named, not silenced. Micro-batches over their
configured budget are listed with the ratio. Offline code: numpy, no torch.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

from rankmem.core.catalogue import phase_key, work_key
from rankmem.core.thresholds import FLOOR_GIB, FRACTION, ImbalanceConfig  # noqa: F401 - re-exported
from rankmem.fit.model import Fit
from rankmem.offline import Run
from rankmem.offline.advice import fit_ranks, memory_kind, work_phases
from rankmem.offline.budget import configured_budget, over_budget

# Balanced 4-rank runs (tests/offline/test_imbalance.py, 20 seeds) stay under 2x their spread; a hidden
# buffer stands at ~20x.
NOTE_SIGMAS = 4.0


@dataclass
class RankExcess:
    """One rank's excess peak in one phase, split into what its tokens explain and the rest (GiB)."""

    phase: str
    rank: int
    excess: float
    explained: float
    unexplained: float
    tokens_excess: float
    """Mean over steps of this rank's heaviest micro-batch tokens over the mean of the ranks."""
    flagged: bool
    noise: float = 0.0
    """Spread (standard deviation) of the step-by-step unexplained part, at least the fit's residual scale."""
    threshold: float = 0.0
    """The unexplained excess over which this phase flags a rank."""
    noted: bool = False
    """Not flagged, yet its unexplained part is over ``NOTE_SIGMAS`` times its noise."""


@dataclass
class OverBudget:
    """A phase's windows whose heaviest micro-batch exceeded the configured budget."""

    phase: str
    budget: int
    windows: int
    over: int
    worst_ratio: float
    worst_step: int
    worst_rank: int


def rank_excess(run: Run, warmup: int = 2, floor_gib: float = FLOOR_GIB,
                fraction: float = FRACTION) -> list[RankExcess]:
    """Every rank's split, per phase with micro-batches and a usable slope; flagged ranks are marked."""
    out: list[RankExcess] = []
    if run.world_size < 2:
        return out
    for phase in work_phases(run):
        fits = fit_ranks(run, phase, warmup)
        slopes = [f.model.per_token() for f in fits if isinstance(f.model, Fit)]
        if not slopes:
            continue
        slope = float(np.median(slopes))
        suffix = "peak_allocated_gib" if memory_kind(run, phase) == "device" else "peak_rss_gib"
        rows = slice(min(warmup, run.steps.size), None)
        peak = run.series[phase_key(phase, suffix)][rows]
        tokens = run.series[work_key(phase, "mb_tokens")][rows]
        both = np.isfinite(peak).all(axis=1) & np.isfinite(tokens).all(axis=1)  # steps every rank reported
        if not both.any():
            continue
        peak, tokens = peak[both], tokens[both]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            per_step = _over_others(peak)
            t_per_step = _over_others(tokens)
        baselines = np.array([f.baseline for f in fits])
        mean_rise = float(np.nanmean(peak.mean(axis=0) - baselines))
        threshold = max(fraction * mean_rise, floor_gib)
        scale = float(np.median([f.model.scale for f in fits if isinstance(f.model, Fit)]))
        for r in range(run.world_size):
            excess, t_excess = float(per_step[:, r].mean()), float(t_per_step[:, r].mean())
            explained = slope * t_excess
            rest = excess - explained
            steps = per_step[:, r] - slope * t_per_step[:, r]
            spread = float(steps.std(ddof=1)) if steps.size > 1 else math.inf
            noise = max(spread, scale)
            flagged = rest > threshold
            out.append(RankExcess(phase, r, excess, explained, rest, t_excess, flagged, noise, threshold,
                                  not flagged and rest > NOTE_SIGMAS * noise))
    return out


def _over_others(matrix: np.ndarray) -> np.ndarray:
    """Per step and rank, its value minus the median of the other ranks' that step: a rank's excess is
    not diluted by its own share, nor moved by another rank's (the logging rank's sinks)."""
    out = np.empty_like(matrix, dtype=np.float64)
    for r in range(matrix.shape[1]):
        out[:, r] = matrix[:, r] - np.median(np.delete(matrix, r, axis=1), axis=1)
    return out


def budget_overruns(run: Run, warmup: int = 2) -> list[OverBudget]:
    """Per phase with a configured budget: how many windows' heaviest micro-batch went over it, the worst."""
    out = []
    for phase in work_phases(run):
        budget = configured_budget(run, phase)
        if budget is None:
            continue
        tokens = run.series[work_key(phase, "mb_tokens")][min(warmup, run.steps.size):]
        over = over_budget(run, phase, budget, warmup)
        windows = int(np.isfinite(tokens).sum())
        if over:
            step, rank, ratio = over[0]
            out.append(OverBudget(phase, budget, windows, len(over), ratio, step, rank))
        else:
            out.append(OverBudget(phase, budget, windows, 0, 1.0, -1, -1))
    return out


def imbalance_lines(excess: list[RankExcess], overruns: list[OverBudget]) -> list[str]:
    """The report's lines: flagged ranks first, then each phase's most loaded rank, then budget overruns."""
    lines = []
    top = {e.phase: e for e in sorted(excess, key=lambda e: e.excess)}  # each phase's most loaded rank
    for e in sorted(excess, key=lambda e: (not e.flagged, -e.excess)):
        if not e.flagged and not e.noted and (top[e.phase] is not e or e.excess <= 0):
            continue
        share = e.explained / e.excess if e.excess > 0 else 0.0
        if e.noted:
            lines.append(f"note {e.phase} rank {e.rank}: {e.unexplained * 1024:+.0f} MiB unexplained, clear of the "
                         f"noise ({e.noise * 1024:.0f} MiB a step) but under the flag threshold of "
                         f"{e.threshold * 1024:.0f} MiB (peak {e.excess * 1024:+.0f} MiB over the other ranks, "
                         f"{e.explained * 1024:+.0f} MiB from its tokens; --imbalance-floor-mib lowers the threshold)")
            continue
        head = "IMBALANCE" if e.flagged else "imbalance"
        lines.append(f"{head} {e.phase} rank {e.rank}: peak {e.excess * 1024:+.0f} MiB over the other ranks, "
                     f"{e.explained * 1024:+.0f} MiB from its tokens ({e.tokens_excess:+.0f} per micro-batch, "
                     f"{share:.0%}), {e.unexplained * 1024:+.0f} MiB unexplained"
                     + (" (not its tokens: an engine, a driver duty, a leak?)" if e.flagged else ""))
    for o in overruns:
        if o.over:
            lines.append(f"over budget: {o.phase}: {o.over} of {o.windows} windows' heaviest micro-batch over the "
                         f"budget {o.budget}, worst {o.worst_ratio:.3f}x (step {o.worst_step}, rank {o.worst_rank})")
    return lines
