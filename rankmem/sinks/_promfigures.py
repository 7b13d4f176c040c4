"""What the ``prometheus`` sink exposes, as plain families of samples: the one place its names are made.

Shared by the HTTP endpoint (:mod:`rankmem.sinks._prometheus`) and the Ray path
(:mod:`rankmem.sinks._raymetrics`), so both show the same figures. The naming scheme (docs/prometheus.md):
``mem/<area>/<name>_gib`` becomes the gauge ``rankmem_<area>_<name>_bytes`` in bytes; a phase key
``mem/phase/<P>/<name>_gib`` becomes ``rankmem_phase_<name>_bytes{phase="<P>"}``; ``..._s`` becomes
``..._seconds``; a count keeps its name; a caller's scalar ``K`` becomes ``rankmem_scalar_<K>``
(characters outside ``[a-zA-Z0-9_]`` as ``_``); label values and help text are made printable. Per key:

- ``<name>{stat="max"|"min"|"mean"}``: the cross-rank aggregates of the last collect (and ``p50``,
  ``p90``, ``p99`` where the collect has them);
- ``rankmem_worst_rank{metric="<name>"}``: the rank holding the worst value, as ``max_rank`` /
  ``min_rank``;
- ``rankmem_rank_<name-without-rankmem_>{rank, local_rank, node, UUID}``: the values of at most
  ``top_k`` worst ranks, from the last collect that carried per-rank detail.

So the series count is at most ``keys x (6 + 1 + top_k) + 8``, whatever the world size.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rankmem.core.catalogue import MEMORY_PREFIX, PHASE_PREFIX, worse, worst_stat
from rankmem.core.records import RankInfo, StepRecord
from rankmem.core.text import printable
from rankmem.forensics.events import KINDS

GIB = 2**30
STATS = ("max", "min", "mean", "p50", "p90", "p99")
"""The quantiles across ranks are there above 128 ranks (the all-reduce path: rankmem.exchange.reduce)."""
RANK_LABELS = ("rank", "local_rank", "node", "UUID")
"""``UUID`` is spelled as NVIDIA's DCGM exporter spells it, so PromQL joins ``on(UUID)``."""
_BAD = re.compile(r"[^a-zA-Z0-9_]")


@dataclass(slots=True)
class Family:
    """One metric family: its name, help, type and samples (label values in ``labels`` order, value)."""

    name: str
    doc: str
    labels: tuple[str, ...]
    counter: bool = False
    samples: list[tuple[tuple[str, ...], float]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class KeyName:
    """How one rankmem key shows: its family, its phase label (None off phases) and its scale to base units."""

    name: str
    phase: str | None
    scale: float
    category: str | None = None
    """The part of a phase's peak (``mem/phase/P/anatomy/<category>_gib``): one family, a label each."""

    def labels(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The phase (and category) label names and values of this key's samples."""
        if self.phase is None:
            return (), ()
        if self.category is None:
            return ("phase",), (self.phase,)
        return ("phase", "category"), (self.phase, self.category)


def key_name(key: str) -> KeyName:
    """The Prometheus name of a per-rank key (the scheme in the module docstring)."""
    phase = category = None
    if key.startswith(PHASE_PREFIX) and key.count("/") >= 3:
        _, _, phase, suffix = key.split("/", 3)
        if suffix.startswith("anatomy/") and suffix.endswith("_gib"):
            suffix, category = "anatomy_gib", _BAD.sub("_", suffix[len("anatomy/"):-len("_gib")])
        body = "phase_" + suffix
    elif key.startswith(MEMORY_PREFIX):
        body = key[len(MEMORY_PREFIX):]
    else:
        body = "scalar_" + key
    scale = 1.0
    if body.endswith("_gib"):
        body, scale = body[: -len("_gib")] + "_bytes", float(GIB)
    elif key.startswith(MEMORY_PREFIX) and body.endswith("_s"):
        body = body[: -len("_s")] + "_seconds"  # Prometheus's base unit spelled out: mem/node/age_s
    return KeyName("rankmem_" + _BAD.sub("_", body), None if phase is None else printable(phase), scale,
                   category)


class Namer:
    """Names per key, made once; two keys that sanitise to one name (``a/b``, ``a_b``) stay apart."""

    def __init__(self) -> None:
        self._names: dict[str, KeyName] = {}
        self._owner: dict[tuple[str, str | None, str | None], str] = {}

    def __call__(self, key: str) -> KeyName:
        found = self._names.get(key)
        if found is None:
            found = key_name(key)
            owner = self._owner.setdefault((found.name, found.phase, found.category), key)
            if owner != key:
                digest = hashlib.sha1(key.encode("utf-8", "replace")).hexdigest()[:8]
                found = KeyName(f"{found.name}_{digest}", found.phase, found.scale, found.category)
            self._names[key] = found
        return found


def rank_labels(ranks: Sequence[RankInfo], rank: int) -> tuple[str, str, str, str]:
    """The labels of one rank: its number, local rank, node and GPU UUID (empty where unknown)."""
    if 0 <= rank < len(ranks):
        info = ranks[rank]
        return (str(rank), str(info.local_rank), printable(info.host),
                printable(getattr(info, "device_uuid", None) or ""))
    return (str(rank), "", "", "")


def worst_ranks(keys: Sequence[str], matrix: Any, k: int) -> list[list[int]]:
    """Per key (column), the rows of at most ``k`` worst ranks, worst first; ranks without the key left out."""
    m = np.asarray(matrix, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] == 0 or k <= 0:
        return [[] for _ in keys]
    # keys x ranks, contiguous, "worse" as larger: every pass below reads memory in order.
    badness = np.array(m.T, dtype=np.float64, order="C")
    low = [j for j, key in enumerate(keys) if worse(key) == "low"]
    badness[low] *= -1.0
    np.nan_to_num(badness, copy=False, nan=-np.inf)
    kk = min(k, m.shape[0])
    if kk <= 8:
        # k passes of argmax beat a partition of every row: a scrape stays well under its target.
        cols, found = np.arange(len(keys)), []
        for _ in range(kk):
            at = badness.argmax(axis=1)
            found.append(at)
            badness[cols, at] = -np.inf
        top = np.stack(found, axis=1)
    else:
        part = np.argpartition(badness, -kk, axis=1)[:, -kk:]
        order = np.argsort(-np.take_along_axis(badness, part, axis=1), axis=1, kind="stable")
        top = np.take_along_axis(part, order, axis=1)
    return [[int(r) for r in top[j] if not np.isnan(m[r, j])] for j in range(len(keys))]


class Figures:
    """Builds the families of one sink's records; keeps the names it made (:class:`Namer`)."""

    def __init__(self, job: str, top_k: int) -> None:
        # Every text that reaches a label value or a HELP line is made printable UTF-8 where it enters (the
        # job's run directory, a phase or host name, a caller's key): bytes that are not UTF-8 (surrogate
        # escapes) made every scrape answer 500 in the encoder. Names are sanitised by key_name.
        self.job = printable(job)
        self.top_k = top_k
        self._namer = Namer()
        self._rows: tuple[Any, list[list[int]]] | None = None  # the last detail matrix and its worst rows

    def families(self, record: StepRecord | None, detail: StepRecord | None, ranks: Sequence[RankInfo],
                 world_size: int, events: Mapping[str, int]) -> list[Family]:
        """Every family for the last ``record`` and the last record with per-rank ``detail``."""
        job = (self.job,)
        out: dict[str, Family] = {}
        head = [Family("rankmem_step", "Step of the last collect", ("job",)),
                Family("rankmem_last_collect_timestamp_seconds", "Unix time of the last collect", ("job",)),
                Family("rankmem_world_size", "Ranks in the job", ("job",), samples=[(job, float(world_size))])]
        if record is not None:
            head[0].samples.append((job, float(record.step)))
            head[1].samples.append((job, float(record.time)))
            self._aggregates(record, out)
        if detail is not None and detail.matrix is not None:
            head.append(Family("rankmem_rank_detail_step", "Step of the collect the per-rank series come from",
                               ("job",), samples=[(job, float(detail.step))]))
            self._per_rank(detail, ranks, out)
        head.append(Family("rankmem_events", "Forensic events written by the job's ranks, by kind",
                           ("job", "kind"), counter=True,
                           samples=[((self.job, kind), float(events.get(kind, 0))) for kind in KINDS]))
        return head + list(out.values())

    def _family(self, out: dict[str, Family], name: str, doc: str, labels: tuple[str, ...]) -> Family:
        found = out.get(name)
        if found is None:
            found = out[name] = Family(name, printable(doc), labels)
        return found

    def _aggregates(self, record: StepRecord, out: dict[str, Family]) -> None:
        metrics = record.metrics
        worst = self._family(out, "rankmem_worst_rank", "Rank holding the worst value of a metric (max, or min "
                             "where low is bad), as the run log's max_rank/min_rank", ("job", "metric", "phase"))
        for key in record.key_names():
            kn = self._namer(key)
            names, phase = kn.labels()
            labels = ("job", "stat", *names)
            fam = self._family(out, kn.name,
                               f"rankmem {key} across ranks (stat: max, min, mean; p50, p90, p99 above 128 ranks)",
                               labels)
            for stat in STATS:
                value = metrics.get(f"{key}/{stat}")
                if value is not None and value == value:
                    fam.samples.append(((self.job, stat, *phase), value * kn.scale))
            at = metrics.get(f"{key}/{worst_stat(key)}_rank")
            if at is not None and at == at:
                metric = kn.name if kn.category is None else f"{kn.name}:{kn.category}"
                worst.samples.append(((self.job, metric, kn.phase or ""), float(at)))

    def _per_rank(self, detail: StepRecord, ranks: Sequence[RankInfo], out: dict[str, Family]) -> None:
        keys = list(detail.keys)
        matrix = np.asarray(detail.matrix, dtype=np.float64)
        cached = self._rows
        if cached is None or cached[0] is not detail.matrix:  # two scrapers (an HA pair) share the work
            cached = self._rows = (detail.matrix, worst_ranks(keys, matrix, self.top_k))
        for col, (key, rows) in enumerate(zip(keys, cached[1], strict=True)):
            kn = self._namer(key)
            names, phase = kn.labels()
            labels = ("job", *RANK_LABELS, *names)
            name = "rankmem_rank_" + kn.name[len("rankmem_"):]
            fam = self._family(out, name, f"rankmem {key} of the top-{self.top_k} worst ranks", labels)
            for r in rows:
                fam.samples.append(((self.job, *rank_labels(ranks, r), *phase), float(matrix[r, col]) * kn.scale))
