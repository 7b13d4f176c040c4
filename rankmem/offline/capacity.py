"""What a run's memory can grow into: device total, node memory, cgroup limit; and how close it came.

``rankmem report`` prints these, ``rankmem plot`` draws them as lines on the panels they bound, so
"how close to OOM" is read off the figure. Per step the capacity is the smallest over ranks (the one
that binds first). Which keys a capacity bounds is derived from the catalogue: the device total bounds
the device's usage keys, the node total and the cgroup limit bound the host's and the node's.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from rankmem.core.catalogue import CATALOGUE, key_of, worse


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
    matrix: np.ndarray
    """Per logged step and rank (nan where a rank did not report it)."""
    steps: np.ndarray
    """The step of each row."""
    room: np.ndarray | None = None
    """Per step and rank, what was left under it (device headroom, node available, cgroup limit - used)."""

    @property
    def per_step(self) -> np.ndarray:
        """Per logged step, the smallest over ranks: the one that binds first (nan where none reported)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a step no rank reported: nan
            return np.asarray(np.nanmin(self.matrix, axis=1))

    @property
    def value(self) -> float:
        """The tightest over the run."""
        return float(np.nanmin(self.per_step))

    def bounds(self, key: str) -> bool:
        """Whether ``key`` is a usage figure this capacity caps (not headroom, not a capacity itself)."""
        spec = next((s for s in CATALOGUE if s.key == key), None)
        return (spec is not None and spec.unit == "GiB" and worse(key) == "high" and _family(key) in self.families
                and key not in CAPACITY_KEYS)

    def least_room(self) -> tuple[float, int, int] | None:
        """(GiB, step, rank) of the least room left under it over the run; None where not measured."""
        if self.room is None or not np.isfinite(self.room).any():
            return None
        row, rank = divmod(int(np.where(np.isfinite(self.room), self.room, np.inf).argmin()), self.room.shape[1])
        return float(self.room[row, rank]), int(self.steps[row]), rank

    def to_json(self) -> dict[str, object]:
        headroom, step, rank = self.least_room() or (None, None, None)
        return {"label": self.label, "capacity": self.value, "headroom": headroom, "step": step, "rank": rank}


CAPACITY_KEYS = (key_of("total"), key_of("cgroup_limit"))


def capacities(series: Mapping[str, np.ndarray], steps: np.ndarray) -> list[Capacity]:
    """The capacities measured in a key -> (steps x ranks) mapping: device total, node total (used +
    available), cgroup limit. The limit per rank set against a fit is :mod:`rankmem.fit.capacity`'s."""
    out = []
    total = series.get(key_of("total"))
    if total is not None and np.isfinite(total).any():
        out.append(Capacity("device total", (DEVICE,), total, steps, series.get(key_of("headroom"))))
    used, available = series.get(key_of("node_used")), series.get(key_of("node_available"))
    if used is not None and available is not None and np.isfinite(used + available).any():
        out.append(Capacity("node total", (HOST, NODE), used + available, steps, available))
    limit, cg_used = series.get(key_of("cgroup_limit")), series.get(key_of("cgroup_used"))
    if limit is not None and np.isfinite(limit).any():
        out.append(Capacity("cgroup limit", (HOST, NODE), limit, steps, None if cg_used is None else limit - cg_used))
    return out


def binding(caps: list[Capacity], key: str) -> np.ndarray | None:
    """Per step and rank, the tightest capacity bounding ``key``; None where none does."""
    bound = [c.matrix for c in caps if c.bounds(key)]
    return np.fmin.reduce(bound) if bound else None


def for_key(caps: list[Capacity], key: str) -> list[Capacity]:
    return [c for c in caps if c.bounds(key)]
