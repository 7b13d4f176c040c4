"""What a leak is growing into: the capacity it will exhaust, when, and which phase leaves it behind.

Shared by the online watch and the offline verdicts, on plain arrays (online code: it imports neither
the run-log reader nor the report).

- **Capacity.** A device series grows into its device (``total - other``); a host series into what
  its node or container has left, shared by every rank on the node, so it runs out at the summed rate of
  the node's leaking host series.
- **Time to exhaustion**: the headroom at the last step over that rate, in steps and in seconds at the
  run's own pace; a straight-line projection.
- **The phase that leaks**: a phase is named when what it leaves behind (its ``..._delta_gib``,
  counted robustly) carries at least half the series' growth over the window.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from rankmem.core.catalogue import key_of
from rankmem.core.units import MIB_PER_GIB

DEVICE_PREFIX = "mem/device/"

# The per-rank figures the projections read, by record field: the catalogue spells their keys.
HOST_CONTEXT = tuple(key_of(f) for f in ("cgroup_limit", "cgroup_working_set", "cgroup_used", "node_available",
                                         "node_used"))
DEVICE_CONTEXT = tuple(key_of(f) for f in ("total", "other"))
CONTEXT_KEYS = HOST_CONTEXT + DEVICE_CONTEXT

_PHASE_MIN_POINTS = 5
_PHASE_SHARE = 0.5
_PHASE_BLOCKS = 10


@dataclass(frozen=True)
class Exhaustion:
    """Where a leaking series runs out of memory at its fitted rate."""

    capacity: str
    """What runs out: ``the node's available memory``, ``the cgroup's memory limit`` or ``device memory``."""
    headroom_mib: float
    """What was left of it at the last examined step."""
    rate_mib: float
    """MiB per step drawn from it: for host memory, every leaking host series on the node together."""
    step: int
    """The projected step at which the headroom is gone."""
    seconds: float | None
    """Seconds from the last examined step to then, at the run's pace; None without step times."""

    def describe(self) -> str:
        when = f"step ~{_round3(self.step):,}"
        if self.seconds is not None:
            when += f" ({_duration(self.seconds)})"
        return f"projected to exhaust {self.capacity} at {when}"


def _round3(n: int) -> int:
    """Three significant figures: a projection is no more precise than that."""
    if n == 0:
        return 0
    digits = int(math.floor(math.log10(abs(n)))) - 2
    return int(round(n, -digits)) if digits > 0 else n


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"~{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"~{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"~{seconds / 3600:.1f} h"
    return f"~{seconds / 86400:.1f} days"


def is_device_key(key: str) -> bool:
    return key.startswith(DEVICE_PREFIX)


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def capacity_gib(key: str, context: Mapping[str, float | None], ranks_sharing: int = 1) -> float | None:
    """The memory one rank's ``key`` series grows into, GiB, for the stakes floor: the device's total,
    or the cgroup limit (else the node's total) shared out over the ``ranks_sharing`` ranks on the node.
    ``context``: that rank's latest figures by key; None where they are missing."""
    if is_device_key(key):
        return _finite(context.get(key_of("total")))
    limit = _finite(context.get(key_of("cgroup_limit")))
    if limit is None:
        used, available = _finite(context.get(key_of("node_used"))), _finite(context.get(key_of("node_available")))
        limit = None if used is None or available is None else used + available
    return None if limit is None else limit / max(ranks_sharing, 1)


def headroom_gib(key: str, context: Mapping[str, float | None], current_gib: float) -> tuple[float, str] | None:
    """What is left for ``key`` to grow into, GiB, and its name; None where the figures are missing.

    Device: ``total - other - current``. Host: the cgroup's limit minus its working set (usage where the
    working set is unknown), else the node's available memory."""
    if is_device_key(key):
        total, other = _finite(context.get(key_of("total"))), _finite(context.get(key_of("other")))
        if total is None or other is None:
            return None
        return total - other - current_gib, "device memory (total - other)"
    limit = _finite(context.get(key_of("cgroup_limit")))
    if limit is not None:
        used = _finite(context.get(key_of("cgroup_working_set")))
        used = used if used is not None else _finite(context.get(key_of("cgroup_used")))
        if used is not None:
            return limit - used, "the cgroup's memory limit"
    available = _finite(context.get(key_of("node_available")))
    return None if available is None else (available, "the node's available memory")


def exhaustion(headroom_gib: float, capacity: str, rate_mib: float, last_step: int,
               seconds_per_step: float | None) -> Exhaustion | None:
    """The projection for ``headroom_gib`` drawn at ``rate_mib`` per step; None for a rate that does not grow."""
    if not rate_mib > 0:
        return None
    steps = max(headroom_gib, 0.0) * MIB_PER_GIB / rate_mib
    seconds = None if seconds_per_step is None else steps * seconds_per_step
    return Exhaustion(capacity=capacity, headroom_mib=headroom_gib * MIB_PER_GIB, rate_mib=rate_mib,
                      step=int(last_step + math.ceil(steps)), seconds=seconds)


def fitted_last(steps: np.ndarray, values_gib: np.ndarray, slope_mib: float, last_step: int) -> float | None:
    """The Theil–Sen line through ``values_gib`` (at ``steps``, nan where absent) at ``last_step``, GiB:
    where a leaking series stands now, without the noise of its last point."""
    ok = np.isfinite(values_gib)
    if not ok.any():
        return None
    slope = slope_mib / MIB_PER_GIB
    return float(np.median(values_gib[ok] - slope * steps[ok])) + slope * last_step


def seconds_per_step(steps: np.ndarray, times: np.ndarray) -> float | None:
    """The run's pace over ``steps`` (logged step numbers) at ``times`` (Unix seconds); None when unknown."""
    ok = np.isfinite(times)
    if ok.sum() < 2:
        return None
    s, t = steps[ok], times[ok]
    span = float(s[-1] - s[0])
    pace = float(t[-1] - t[0]) / span if span > 0 else math.nan
    return pace if math.isfinite(pace) and pace > 0 else None


def leaking_phase(deltas_gib: Mapping[str, np.ndarray], growth_mib: float) -> str | None:
    """The phase that leaves the growth behind: ``deltas_gib`` maps each phase to its per-row deltas
    (GiB, nan where the phase did not run) over the examined rows; ``growth_mib`` is the series' growth
    over them. None when no phase clearly carries it.

    What a phase leaves is counted robustly, as the larger of the median delta times the rows and, for a
    leak that lands in chunks, the median of ``_PHASE_BLOCKS`` block sums times the blocks (only where
    three blocks in four gained); it must reach ``_PHASE_SHARE`` of the growth.
    """
    best: tuple[float, str] | None = None
    for phase, values in deltas_gib.items():
        d = values[np.isfinite(values)] * MIB_PER_GIB
        if d.size < _PHASE_MIN_POINTS:
            continue
        sums = np.array([b.sum() for b in np.array_split(d, min(_PHASE_BLOCKS, d.size))])
        chunks = float(np.median(sums)) * sums.size if np.quantile(sums, 0.25) > 0 else 0.0
        total = max(float(np.median(d)) * d.size, chunks)
        if total > 0 and total >= _PHASE_SHARE * growth_mib and (best is None or total > best[0]):
            best = (total, phase)
    return None if best is None else best[1]
