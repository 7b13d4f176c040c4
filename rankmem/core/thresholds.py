"""The offline verdicts' thresholds and defaults: a leak (:class:`LeakConfig`), a rank's unexplained excess
(:class:`ImbalanceConfig`). No numpy: the CLI's help shows these defaults without loading the verdicts'."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rankmem.core.units import MIB_PER_GIB
from rankmem.errors import RankmemError

_OWN_MIB = 4.0  # the least stakes floor where capacity is known: rankmem's own settling is no leak of the job's


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
    noise_factor: float = 3.0
    """The growth over the window must exceed this many noise standard deviations (plus the stakes floor)."""
    capacity_fraction: float = 1e-4
    """The stakes floor: this share of the memory the series grows into (device total; the rank's share
    of its cgroup limit or node memory), in MiB of growth over the window; at least 4 MiB (rankmem's own)."""
    min_growth_mib: float = 8.0
    """The stakes floor, MiB, where the capacity is unknown."""
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
        if self.noise_factor < 0:
            raise RankmemError(f"noise_factor must be >= 0, got {self.noise_factor}")
        if not 0.0 <= self.capacity_fraction < 1.0:
            raise RankmemError(f"capacity_fraction must be in [0, 1), got {self.capacity_fraction}")
        if self.min_growth_mib < 0:
            raise RankmemError(f"min_growth_mib must be >= 0, got {self.min_growth_mib}")
        if self.max_points < 8:
            raise RankmemError(f"max_points must be at least 8, got {self.max_points}")

    def stakes_mib(self, capacity_gib: float | None) -> float:
        """The stakes floor for a series growing into ``capacity_gib`` (None: unknown)."""
        if capacity_gib is None or not math.isfinite(capacity_gib) or capacity_gib <= 0:
            return self.min_growth_mib
        return max(self.capacity_fraction * capacity_gib * MIB_PER_GIB, min(_OWN_MIB, self.min_growth_mib))


FLOOR_GIB = 0.25
FRACTION = 0.10


@dataclass(frozen=True)
class ImbalanceConfig:
    """When a rank's unexplained excess is flagged: over ``max(fraction x mean peak rise, floor_gib)``."""

    floor_gib: float = FLOOR_GIB
    """The least unexplained excess that is flagged, GiB (``rankmem report --imbalance-floor-mib``)."""
    fraction: float = FRACTION
    """The share of the phase's mean peak rise that is flagged (``--imbalance-fraction``)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.floor_gib) and self.floor_gib >= 0):
            raise RankmemError(f"the imbalance floor must be a size >= 0, got {self.floor_gib * 1024:g} MiB")
        if not (math.isfinite(self.fraction) and 0 <= self.fraction <= 1):
            raise RankmemError(f"the imbalance fraction must be between 0 and 1, got {self.fraction:g}")
