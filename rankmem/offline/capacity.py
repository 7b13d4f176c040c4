"""What a run's memory can grow into: device total, node memory, cgroup limit; and how close it came.

``rankmem report`` prints these, ``rankmem plot`` draws them as lines on the panels they bound, so
"how close to OOM" is read off the figure. Per step the capacity is the smallest over ranks (the one
that binds first). Which keys a capacity bounds is derived from the catalogue: the device total bounds
the device's usage keys, the node total and the cgroup limit bound the host's and the node's.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from rankmem.core.catalogue import CATALOGUE, key_of, worse
from rankmem.offline import Run


def _family(key: str) -> str:
    """``mem/device``, ``mem/host`` or ``mem/node``: the part of a catalogue key before its name."""
    return key.rsplit("/", 1)[0]


DEVICE = _family(key_of("total"))
NODE = _family(key_of("node_available"))
HOST = _family(key_of("rss"))


@dataclass
class Capacity:
    label: str
    families: tuple[str, ...]
    """The key families (:func:`_family`) whose usage keys it bounds."""
    per_step: np.ndarray
    """Per logged step, the smallest over ranks (nan where no rank reported it)."""

    @property
    def value(self) -> float:
        """The tightest over the run."""
        return float(np.nanmin(self.per_step))

    def bounds(self, key: str) -> bool:
        """Whether ``key`` is a usage figure this capacity caps (not headroom, not a capacity itself)."""
        spec = next((s for s in CATALOGUE if s.key == key), None)
        return (spec is not None and spec.unit == "GiB" and worse(key) == "high" and _family(key) in self.families
                and key not in CAPACITY_KEYS)


CAPACITY_KEYS = (key_of("total"), key_of("cgroup_limit"))


def _min_over_ranks(matrix: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a step no rank reported: nan
        return np.asarray(np.nanmin(matrix, axis=1))


def capacities(run: Run) -> list[Capacity]:
    """The run's capacities that were measured: device total, node total (used + available), cgroup limit."""
    out = []
    total = run.series.get(key_of("total"))
    if total is not None and np.isfinite(total).any():
        out.append(Capacity("device total", (DEVICE,), _min_over_ranks(total)))
    used, available = run.series.get(key_of("node_used")), run.series.get(key_of("node_available"))
    if used is not None and available is not None and np.isfinite(used + available).any():
        out.append(Capacity("node total", (HOST, NODE), _min_over_ranks(used + available)))
    limit = run.series.get(key_of("cgroup_limit"))
    if limit is not None and np.isfinite(limit).any():
        out.append(Capacity("cgroup limit", (HOST, NODE), _min_over_ranks(limit)))
    return out


def for_key(caps: list[Capacity], key: str) -> list[Capacity]:
    return [c for c in caps if c.bounds(key)]
