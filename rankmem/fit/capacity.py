"""What one rank may use, and whether a phase's fitted peak fits under it: the one owner of both.

``rankmem advise``, ``report``, ``watch``, the HTML page and the online warning all call it, over a
mapping of key -> (steps x ranks) GiB: the run log's arrays offline, the watch's history online.
Device: the device total, the smallest over ranks and steps. Host: the tightest of the cgroup limit and
the node's total memory, each less the most the node's other processes held under it (its use minus its
ranks' RSS: the launcher, torchrun's agent, dataloader workers, anything else), shared by the node's
ranks; the tightest node binds.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rankmem.core.catalogue import key_of
from rankmem.errors import RankmemError
from rankmem.fit.model import Fit, NoFit
from rankmem.fit.series import PhaseFit

HEADROOM_FRACTION = 0.05
"""The headroom kept under the capacity where none is asked for."""

Series = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class Limit:
    """The memory each rank may use: capacity (and where it comes from) and the headroom kept."""

    capacity: float
    source: str
    headroom: float

    @property
    def usable(self) -> float:
        return self.capacity - self.headroom


def limit(series: Series, hosts: Sequence[str], kind: str, capacity: float | None = None,
          headroom: float | None = None) -> Limit:
    """The limit of a run's ranks (``capacity`` given: that one, from ``--capacity``); RankmemError
    where the run measured no capacity or the headroom leaves nothing."""
    cap, source = (capacity, "--capacity") if capacity is not None else rank_capacity(series, hosts, kind)
    kept = headroom if headroom is not None else HEADROOM_FRACTION * cap
    if kept >= cap:
        raise RankmemError(f"--headroom {kept:g} GiB leaves nothing of the capacity {cap:.3f} GiB: lower it")
    return Limit(cap, source, kept)


def rank_capacity(series: Series, hosts: Sequence[str], kind: str) -> tuple[float, str]:
    """(GiB per rank, where it comes from) as the module docstring says; RankmemError without one."""
    if kind == "device":
        total = _finite(series.get(key_of("total")))
        if total is None:
            raise RankmemError("the run has no device total: pass --capacity GIB")
        return float(np.min(total)), "device total"
    found = []
    for label, cap, used in (("cgroup limit", _finite(series.get(key_of("cgroup_limit"))), _cgroup_used(series)),
                             ("node total", _node_total(series), series.get(key_of("node_used")))):
        if cap is not None:
            found.append(_tightest_node(label, float(np.min(cap)), used, series.get(key_of("rss")), hosts))
    if not found:
        raise RankmemError("the run has neither a cgroup limit nor the node's memory: pass --capacity GIB")
    return min(found)


def _finite(matrix: np.ndarray | None) -> np.ndarray | None:
    if matrix is None:
        return None
    values = np.asarray(matrix, dtype=np.float64)
    values = values[np.isfinite(values)]
    return values if values.size else None


def _node_total(series: Series) -> np.ndarray | None:
    used, available = series.get(key_of("node_used")), series.get(key_of("node_available"))
    return None if used is None or available is None else _finite(np.asarray(used) + np.asarray(available))


def _cgroup_used(series: Series) -> np.ndarray | None:
    """The cgroup's working set (what its OOM killer weighs), else its usage."""
    for name in ("cgroup_working_set", "cgroup_used"):
        matrix = series.get(key_of(name))
        if _finite(matrix) is not None:
            return matrix
    return None


def _tightest_node(label: str, cap: float, used: np.ndarray | None, rss: np.ndarray | None,
                   hosts: Sequence[str]) -> tuple[float, str]:
    best: tuple[float, float, int] | None = None
    for host in sorted(set(hosts)):
        ranks = [k for k, h in enumerate(hosts) if h == host]
        other = _others(used, rss, ranks)
        per_rank = (cap - other) / len(ranks)
        if best is None or per_rank < best[0]:
            best = (per_rank, other, len(ranks))
    assert best is not None, "a run has at least one rank"
    per_rank, other, share = best
    said = label + (f" less {other:.3f} GiB of other processes" if other > 0 else "")
    return per_rank, said + (f" / {share} ranks" if share > 1 else "")


def _others(used: np.ndarray | None, rss: np.ndarray | None, ranks: list[int]) -> float:
    """GiB the node's other processes held at most: its use (the same figure on each of its ranks) minus
    its ranks' RSS; 0 where either is missing. A rank's file pages the node did not charge to it make
    this smaller, not larger: it is the part of the limit the ranks' RSS cannot have."""
    if used is None or rss is None:
        return 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a step no rank reported: nan
        node = np.nanmedian(np.asarray(used, dtype=np.float64)[:, ranks], axis=1)
    other = _finite(node - np.sum(np.asarray(rss, dtype=np.float64)[:, ranks], axis=1))
    return max(float(other.max()), 0.0) if other is not None else 0.0


@dataclass(frozen=True)
class Verdict:
    """Whether one phase's fitted peak at its heaviest micro-batch seen fits the limit."""

    phase: str
    fits: bool | None
    """None: no rank has a model (``reason`` says why)."""
    rank: int | None = None
    """The rank whose fitted peak (the interval's high end) comes closest to the limit."""
    tokens: float | None = None
    """That rank's heaviest micro-batch seen."""
    high_gib: float | None = None
    reason: str | None = None

    def describe(self, limit: Limit) -> str:
        if self.fits is None:
            return f"{self.phase}: no verdict: {self.reason}"
        return (f"{self.phase}: {'fits' if self.fits else 'OVER'}: fitted peak at its heaviest micro-batch seen "
                f"({self.tokens:.0f} tokens, rank {self.rank}) {self.high_gib:.3f} GiB of usable {limit.usable:.3f}")


def verdict(fits: Sequence[PhaseFit], limit: Limit) -> Verdict:
    """One phase's verdict from its ranks' fits: the high end of each rank's predicted peak at the
    heaviest micro-batch it saw, against capacity minus headroom."""
    worst: tuple[float, PhaseFit, float] | None = None
    for pf in fits:
        if pf.tokens_seen.size and isinstance(pf.model, Fit):
            heaviest = float(pf.tokens_seen.max())
            high = pf.peak(heaviest)[2]
            if worst is None or high > worst[0]:
                worst = (high, pf, heaviest)
    if worst is None:
        reasons = [pf.model.reason for pf in fits if isinstance(pf.model, NoFit)]
        return Verdict(fits[0].phase if fits else "?", None, reason=reasons[0] if reasons else "no windows")
    high, pf, heaviest = worst
    return Verdict(pf.phase, bool(high <= limit.usable), pf.rank, heaviest, float(high))
