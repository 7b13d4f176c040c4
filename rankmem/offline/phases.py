"""Per-phase figures of a run: how high each phase peaks and what it leaves behind, rank by rank.

For each phase ``P`` and each of its keys ``mem/phase/P/<suffix>`` (:data:`PHASE_CATALOGUE`):

- the worst single value over the run with its step and rank (the catalogue's direction: for peaks
  and deltas, high is bad);
- the per-step mean: the mean over steps of that step's worst rank, i.e. the typical step;
- for the deltas (``rss_delta_gib``, ``allocated_delta_gib``: what the phase left allocated when it
  ended), the total over the run for the rank that accumulated most: a phase that leaks adds up here
  while its per-step delta stays small.

Offline code over :class:`rankmem.offline.Run`'s arrays (numpy, no torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rankmem.core.catalogue import PHASE_CATALOGUE, phase_key, worse
from rankmem.offline import Run

DELTA_FIELDS = ("rss_delta", "allocated_delta")
"""The :class:`~rankmem.core.records.PhaseBytes` fields that say what a phase leaves behind."""


@dataclass
class PhaseRow:
    """One key of one phase over the run."""

    phase: str
    key: str
    """The per-phase key's suffix (``peak_rss_gib``, ``rss_delta_gib``, ...)."""
    worst: float
    step: int
    rank: int
    mean_per_step: float
    """Mean over steps of each step's worst rank."""
    total: float | None = None
    """Deltas only: the largest per-rank sum over the run (what the phase left behind in all)."""
    total_rank: int | None = None


def worst_of(matrix: np.ndarray, low: bool) -> tuple[np.ndarray, int]:
    """``matrix`` with its NaN and infinities made the best value, and the flat index of its worst value
    (ties: earliest step, then lowest rank); ``matrix`` itself where that changes nothing (no copy)."""
    flat = first_extreme(matrix, low)  # a NaN, or the infinity at the worse end, wins
    if math.isfinite(matrix.flat[flat]):
        return matrix, flat
    filled = np.where(np.isfinite(matrix), matrix, np.inf if low else -np.inf)
    return filled, first_extreme(filled, low)


def first_extreme(matrix: np.ndarray, low: bool) -> int:
    """``matrix.argmin()`` (``low``) or ``argmax()`` of a (steps x ranks) matrix, a NaN first, without the
    copy a flat argmax makes of the reader's column-major series: the first row holding it, then its rank."""
    pick = np.argmin if low else np.argmax
    row = int(pick(matrix.min(axis=1) if low else matrix.max(axis=1)))  # a row's NaN is its min and max
    return row * int(matrix.shape[1]) + int(pick(matrix[row]))


def phase_rows(run: Run) -> list[PhaseRow]:
    """Every phase's rows, phases sorted by name; within a phase its peaks, then what it left behind."""
    rows = []
    memory = [s for s in PHASE_CATALOGUE if s.unit == "GiB"]  # the work counts are the advice's, not memory
    ordered = sorted(memory, key=lambda s: s.field in DELTA_FIELDS)  # stable: catalogue order within
    for phase in run.phases():
        for spec in ordered:
            matrix = run.series.get(phase_key(phase, spec.key))
            if matrix is None or not np.isfinite(matrix).any():
                continue
            rows.append(_row(run, phase, spec.key, spec.field, matrix))
    return rows


def _row(run: Run, phase: str, suffix: str, field: str, matrix: np.ndarray) -> PhaseRow:
    low = worse(phase_key(phase, suffix)) == "low"
    filled, flat = worst_of(matrix, low)
    row, rank = divmod(flat, matrix.shape[1])
    per_step = filled.min(axis=1) if low else filled.max(axis=1)
    per_step = per_step[np.isfinite(per_step)]  # a step where no rank ran the phase is skipped
    out = PhaseRow(phase=phase, key=suffix, worst=float(matrix[row, rank]), step=int(run.steps[row]), rank=rank,
                   mean_per_step=float(per_step.mean()) if per_step.size else math.nan)
    if field in DELTA_FIELDS:
        totals = np.nansum(matrix, axis=0)
        out.total_rank = int(totals.argmax())
        out.total = float(totals[out.total_rank])
    return out
