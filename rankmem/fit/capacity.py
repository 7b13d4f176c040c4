"""What a run's memory can grow into, what one rank may use, and whether a phase's fitted peak fits.

The one owner of capacity for ``rankmem advise``, ``report``, ``plot``, ``watch``, the HTML page and the
online warning, over a mapping of key -> (steps x ranks) GiB: the run log's arrays, the watch's history.
:func:`capacities`: the device total, node total and cgroup limit, each bounding the usage keys of its
families. :func:`limit`: what one rank may use. On the device the device total; on the host the
tightest of the cgroup limit and the node's total, each less the most the node's other processes held
under it (its use minus its ranks' RSS: the launcher, torchrun's agent, dataloader workers), shared by
the node's ranks; the tightest node binds.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from rankmem.core.catalogue import CATALOGUE, PHASE_PREFIX, key_of, phase_names, work_key, worse
from rankmem.errors import RankmemError
from rankmem.fit import HEADROOM_FRACTION
from rankmem.fit.held import HELD_PARTS
from rankmem.fit.model import Fit, NoFit
from rankmem.fit.series import PhaseFit, fit_ranks, memory_kind

Series = Mapping[str, np.ndarray]


def _family(key: str) -> str:
    """``mem/device``, ``mem/host`` or ``mem/node``: the part of a catalogue key before its name."""
    return key.rsplit("/", 1)[0]


DEVICE, NODE, HOST = _family(key_of("total")), _family(key_of("node_available")), _family(key_of("rss"))
CAPACITY_KEYS = (key_of("total"), key_of("cgroup_limit"))


@dataclass
class Capacity:
    label: str
    families: tuple[str, ...]
    """The key families (:func:`_family`) whose usage keys it bounds."""
    matrix: np.ndarray
    """Per logged step and rank (nan where a rank did not report it)."""
    steps: np.ndarray
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
        return (spec is not None and spec.unit == "GiB" and worse(key) == "high"
                and _family(key) in self.families and key not in CAPACITY_KEYS)

    def least_room(self) -> tuple[float, int, int] | None:
        """(GiB, step, rank) of the least room left under it over the run; None where not measured."""
        if self.room is None or not np.isfinite(self.room).any():
            return None
        flat = int(np.where(np.isfinite(self.room), self.room, np.inf).argmin())
        row, rank = divmod(flat, self.room.shape[1])
        return float(self.room[row, rank]), int(self.steps[row]), rank

    def to_json(self) -> dict[str, Any]:
        headroom, step, rank = self.least_room() or (None, None, None)
        return {"label": self.label, "capacity": self.value, "headroom": headroom, "step": step, "rank": rank}


def capacities(series: Series, steps: np.ndarray) -> list[Capacity]:
    """The capacities measured: device total, node total (used + available), cgroup limit."""
    total, used, available = (series.get(key_of(k)) for k in ("total", "node_used", "node_available"))
    cgroup, cgroup_used = series.get(key_of("cgroup_limit")), series.get(key_of("cgroup_used"))
    node = None if used is None or available is None else used + available
    cgroup_room = None if cgroup is None or cgroup_used is None else cgroup - cgroup_used
    found = [("device total", (DEVICE,), total, series.get(key_of("headroom"))),
             ("node total", (HOST, NODE), node, available),
             ("cgroup limit", (HOST, NODE), cgroup, cgroup_room)]
    return [Capacity(label, families, m, steps, room) for label, families, m, room in found
            if m is not None and np.isfinite(m).any()]


def for_key(caps: list[Capacity], key: str) -> list[Capacity]:
    return [c for c in caps if c.bounds(key)]


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
    """The limit per rank (``capacity`` given: that one, from ``--capacity``), as the module docstring
    says; RankmemError where the run measured no capacity or the headroom leaves nothing."""
    if capacity is not None:
        cap, source = capacity, "--capacity"
    elif kind == "device":
        if (total := _finite(series.get(key_of("total")))) is None:
            raise RankmemError("the run has no device total: pass --capacity GIB")
        cap, source = float(total.min()), "device total"
    else:
        rss, found = series.get(key_of("rss")), []
        used, available = series.get(key_of("node_used")), series.get(key_of("node_available"))
        node = None if used is None or available is None else used + available
        for label, total, held in (("cgroup limit", series.get(key_of("cgroup_limit")), _cgroup_used(series)),
                                   ("node total", node, used)):
            if (finite := _finite(total)) is not None:
                found.append(_tightest_node(label, float(finite.min()), held, rss, hosts))
        if not found:
            raise RankmemError("the run has neither a cgroup limit nor the node's memory: "
                               "pass --capacity GIB")
        cap, source = min(found)
    kept = headroom if headroom is not None else HEADROOM_FRACTION * cap
    if kept >= cap:
        raise RankmemError(f"--headroom {kept:g} GiB leaves nothing of the capacity {cap:.3f} GiB: lower it")
    return Limit(cap, source, kept)


def _finite(matrix: np.ndarray | None) -> np.ndarray | None:
    values = None if matrix is None else np.asarray(matrix, dtype=np.float64)
    return None if values is None or not np.isfinite(values).any() else values[np.isfinite(values)]


def _cgroup_used(series: Series) -> np.ndarray | None:
    """The cgroup's working set (what its OOM killer weighs), else its usage."""
    return next((m for k in ("cgroup_working_set", "cgroup_used")
                 if _finite(m := series.get(key_of(k))) is not None), None)


def _tightest_node(label: str, cap: float, used: np.ndarray | None, rss: np.ndarray | None,
                   hosts: Sequence[str]) -> tuple[float, str]:
    nodes = [[k for k, h in enumerate(hosts) if h == host] for host in sorted(set(hosts))]
    per_rank, other, share = min(((cap - (o := _others(used, rss, ranks))) / len(ranks), o, len(ranks))
                                 for ranks in nodes)
    said = label + (f" less {other:.3f} GiB of other processes" if other > 0 else "")
    return per_rank, said + (f" / {share} ranks" if share > 1 else "")


def _others(used: np.ndarray | None, rss: np.ndarray | None, ranks: list[int]) -> float:
    """GiB the node's other processes held at most: its use (the same figure on each of its ranks) minus
    its ranks' RSS; 0 where either is missing. A rank's file pages the node did not charge to it make
    this smaller, not larger: it is the part of the limit the ranks' RSS cannot have."""
    if used is None or rss is None:
        return 0.0
    # The median over the node's ranks, NaN (a step no rank reported) aside: np.nanmedian over so few
    # columns goes through numpy.ma, whose import costs `rankmem report` more than this whole function.
    by_rank = np.sort(np.asarray(used, dtype=np.float64)[:, ranks], axis=1)  # NaN sorts last
    n, rows = (~np.isnan(by_rank)).sum(axis=1), np.arange(len(by_rank))
    node = (by_rank[rows, (n - 1) // 2] + by_rank[rows, n // 2]) / 2  # NaN where n == 0
    other = _finite(node - np.sum(np.asarray(rss, dtype=np.float64)[:, ranks], axis=1))
    return max(float(other.max()), 0.0) if other is not None else 0.0


@dataclass(frozen=True)
class Verdict:
    """Whether one phase's fitted peak at its heaviest micro-batch seen fits the limit: the rank whose
    fitted peak (the interval's high end) comes closest, at its heaviest ``tokens``."""

    phase: str
    fits: bool | None
    """None: no rank has a model (``reason`` says why)."""
    rank: int | None = None
    tokens: float | None = None
    high_gib: float | None = None
    reason: str | None = None

    def describe(self, limit: Limit) -> str:
        if self.fits is None:
            return f"{self.phase}: no verdict: {self.reason}"
        return (f"{self.phase}: {'fits' if self.fits else 'OVER'}: fitted peak at its heaviest micro-batch "
                f"seen ({self.tokens:.0f} tokens, rank {self.rank}) {self.high_gib:.3f} GiB of usable "
                f"{limit.usable:.3f}")


def verdict(fits: Sequence[PhaseFit], limit: Limit) -> Verdict:
    """One phase's verdict from its ranks' fits."""
    judged = [(pf.peak(t := float(pf.tokens_seen.max()))[2], pf.rank, t) for pf in fits
              if pf.tokens_seen.size and isinstance(pf.model, Fit)]
    if not judged:
        reasons = [pf.model.reason for pf in fits if isinstance(pf.model, NoFit)]
        return Verdict(fits[0].phase, None, reason=reasons[0] if reasons else "no windows")
    high, rank, tokens = max(judged)
    return Verdict(fits[0].phase, bool(high <= limit.usable), rank, tokens, float(high))


@dataclass(frozen=True)
class Assessment:
    """The limit per rank and, per phase told its micro-batches, the verdict against it."""

    limit: Limit | None
    verdicts: list[Verdict]
    reason: str | None = None
    """Why there is no limit (the run measured no capacity)."""

    def lines(self) -> list[str]:
        if self.limit is None:
            return [f"capacity: none per rank ({self.reason})"] if self.reason else []
        lim = self.limit
        return [f"capacity {lim.capacity:.3f} GiB per rank ({lim.source}), headroom {lim.headroom:.3f} GiB: "
                f"usable {lim.usable:.3f} GiB", *(f"  {v.describe(lim)}" for v in self.verdicts)]

    def to_json(self) -> dict[str, Any]:
        return {"limit": None if self.limit is None else {**asdict(self.limit), "usable": self.limit.usable},
                "verdicts": [asdict(v) for v in self.verdicts], "reason": self.reason}


_READ = {key_of(n) for n in ("total", "cgroup_limit", "cgroup_working_set", "cgroup_used", "node_used",
                              "node_available", "rss", "allocated", "other")}
_READ_PER_PHASE = tuple(work_key("", f).rsplit("/", 1)[1] for f in ("mb_tokens", "mb_sq_tokens")) + (
    "peak_allocated_gib", "peak_rss_gib", "peak_reserved_gib", "peak_reserved_rise_gib",
    *(f"{part}_gib" for part in HELD_PARTS))  # mem/phase/P/anatomy/<part>_gib: what the fit takes off


def read_by_assess(key: str) -> bool:
    """Whether :func:`assess` reads ``key``: the online watch keeps only those."""
    return key in _READ or (key.startswith(PHASE_PREFIX) and key.rsplit("/", 1)[1] in _READ_PER_PHASE)


def assess(series: Series, steps: np.ndarray, hosts: Sequence[str], warmup: int) -> Assessment:
    """The limit and every phase's verdict, as ``rankmem report``, ``watch``, the HTML page and the
    online warning give them (``advise`` too): the first phase told its micro-batches says the kind."""
    phases = [p for p in phase_names(series) if work_key(p, "mb_tokens") in series]
    kind = memory_kind(series, phases[0]) if phases else "device" if key_of("total") in series else "host"
    try:
        lim = limit(series, hosts, kind)
    except RankmemError as exc:
        return Assessment(None, [], str(exc))
    return Assessment(lim, [_verdict(series, steps, p, warmup, lim) for p in phases])


def _verdict(series: Series, steps: np.ndarray, phase: str, warmup: int, lim: Limit) -> Verdict:
    try:
        return verdict(fit_ranks(series, steps, phase, warmup), lim)
    except RankmemError as exc:  # a phase told its tokens whose peaks the run did not measure
        return Verdict(phase, None, reason=str(exc))
