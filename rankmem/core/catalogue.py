"""The metric catalogue: the one place rankmem's metric names are spelled.

Every other module derives what it needs from :data:`CATALOGUE`: the console headline, the keys the
report and plot show first, the leak baselines, the keys ``rankmem train`` summarises, verl's names and
"the phase that set a step's peak". README's metric table is held to this table by a test.

Records hold bytes (:class:`rankmem.core.records.WindowBytes`); :func:`window_metrics` is where bytes become
``_gib`` keys, once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from rankmem.core.records import PhaseBytes, WindowBytes
from rankmem.core.units import GIB

Worse = Literal["high", "low"]

AGGREGATES = ("max", "min", "mean", "max_rank", "min_rank")
"""What every per-rank key ``K`` becomes after aggregation: ``K/max``, ... ``K/min_rank``."""

MEMORY_PREFIX = "mem/"
PHASE_PREFIX = MEMORY_PREFIX + "phase/"
PHASE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
OUTSIDE_PHASES = "(outside phases)"


@dataclass(frozen=True, slots=True)
class KeySpec:
    """One per-rank metric key and everything rankmem knows about it."""

    key: str
    field: str
    """The :class:`~rankmem.core.records.WindowBytes` attribute (bytes or a count) it is made from."""
    unit: Literal["GiB", "count"]
    worse: Worse = "high"
    """Which end is dangerous: ``high`` for usage and peaks, ``low`` for headroom and available memory."""
    phase_suffix: str | None = None
    """For a step peak, the per-phase key ``mem/phase/P/<suffix>`` that holds the same peak inside P."""
    leak: bool = False
    """A leak baseline: what a leak grows (peaks and reserved memory follow, with more noise)."""
    phase_delta: str | None = None
    """The per-phase key ``mem/phase/P/<phase_delta>`` holding what phase P left of this key behind:
    the leak verdicts name the phase that carries a leak's growth."""
    headline: str | None = None
    """The console label, for the few keys that say who is close to running out."""
    summary: bool = False
    """``rankmem train``'s end-of-run summary names this key's run peak, rank, step and phase."""
    plot: bool = False
    """Drawn by ``rankmem plot`` when no keys are given."""
    verl: str | None = None
    """verl's engine-worker name for ``K/max`` (its "gb" is GiB: verl divides by 1024**3 too)."""

    def worst_stat(self) -> str:
        """``max`` or ``min``: the aggregate that holds the worst rank's value."""
        return "min" if self.worse == "low" else "max"


CATALOGUE: tuple[KeySpec, ...] = (
    KeySpec("mem/host/rss_gib", "rss", "GiB", leak=True, phase_delta="rss_delta_gib", headline="rss", plot=True,
            verl="perf/cpu_memory_used_gb"),
    KeySpec("mem/host/peak_rss_gib", "peak_rss", "GiB", phase_suffix="peak_rss_gib", headline="peak_rss",
            summary=True, plot=True),
    KeySpec("mem/host/lifetime_peak_rss_gib", "lifetime_peak_rss", "GiB"),
    # Summed child RSS counts pages forked workers share with this process once per worker; the console
    # and the summary show what the workers add (USS). RSS stays the leak baseline: it is read every
    # collect, and a worker's private growth shows in it all the same.
    KeySpec("mem/host/children_rss_gib", "children_rss", "GiB", leak=True),
    KeySpec("mem/host/children_uss_gib", "children_uss", "GiB", headline="children", summary=True),
    KeySpec("mem/host/pinned_gib", "pinned", "GiB"),
    KeySpec("mem/host/lifetime_peak_pinned_gib", "lifetime_peak_pinned", "GiB"),
    KeySpec("mem/node/used_gib", "node_used", "GiB"),
    KeySpec("mem/node/available_gib", "node_available", "GiB", worse="low"),
    KeySpec("mem/node/cgroup_used_gib", "cgroup_used", "GiB"),
    KeySpec("mem/node/cgroup_limit_gib", "cgroup_limit", "GiB"),
    KeySpec("mem/node/cgroup_working_set_gib", "cgroup_working_set", "GiB"),
    KeySpec("mem/device/allocated_gib", "allocated", "GiB", leak=True, phase_delta="allocated_delta_gib"),
    KeySpec("mem/device/reserved_gib", "reserved", "GiB"),
    KeySpec("mem/device/peak_allocated_gib", "peak_allocated", "GiB", phase_suffix="peak_allocated_gib",
            summary=True, verl="perf/max_memory_allocated_gb"),
    KeySpec("mem/device/peak_reserved_gib", "peak_reserved", "GiB", phase_suffix="peak_reserved_gib",
            headline="dev_peak_res", summary=True, plot=True, verl="perf/max_memory_reserved_gb"),
    KeySpec("mem/device/lifetime_peak_reserved_gib", "lifetime_peak_reserved", "GiB"),
    KeySpec("mem/device/inactive_split_gib", "inactive_split", "GiB"),
    KeySpec("mem/device/used_gib", "used", "GiB", summary=True),
    KeySpec("mem/device/other_gib", "other", "GiB"),
    KeySpec("mem/device/total_gib", "total", "GiB"),
    KeySpec("mem/device/headroom_gib", "headroom", "GiB", worse="low", headline="dev_headroom", summary=True),
    # `other` by owner (docs/device-attribution.md): NVML's processes on the device, every ~10 s.
    KeySpec("mem/device/nontorch_gib", "device_nontorch", "GiB"),
    KeySpec("mem/device/siblings_gib", "device_siblings", "GiB"),
    KeySpec("mem/device/descendants_gib", "device_descendants", "GiB"),
    KeySpec("mem/device/foreign_gib", "device_foreign", "GiB"),
    KeySpec("mem/device/unattributed_gib", "device_unattributed", "GiB"),
    KeySpec("mem/device/alloc_retries", "alloc_retries", "count"),
    KeySpec("mem/device/ooms", "ooms", "count"),
)

PHASE_CATALOGUE: tuple[KeySpec, ...] = (
    KeySpec("peak_rss_gib", "peak_rss", "GiB"),
    KeySpec("rss_delta_gib", "rss_delta", "GiB"),
    KeySpec("peak_allocated_gib", "peak_allocated", "GiB"),
    KeySpec("peak_reserved_gib", "peak_reserved", "GiB"),
    KeySpec("allocated_delta_gib", "allocated_delta", "GiB"),
    KeySpec("descendants_gib", "device_descendants", "GiB"),
)
"""Per phase ``P``: the keys ``mem/phase/P/<key>`` (a :class:`~rankmem.core.records.PhaseBytes` field each)."""

SPECS: dict[str, KeySpec] = {s.key: s for s in CATALOGUE}
LEAK_KEYS = tuple(s.key for s in CATALOGUE if s.leak)
SUMMARY_KEYS = tuple(s.key for s in CATALOGUE if s.summary)
PLOT_KEYS = tuple(s.key for s in CATALOGUE if s.plot)
HEADLINE = tuple((s.headline, s) for s in CATALOGUE if s.headline)
LOW_IS_BAD = tuple(s.key for s in CATALOGUE if s.worse == "low")
PHASE_SUFFIX = {s.key: s.phase_suffix for s in CATALOGUE if s.phase_suffix}
PHASE_DELTA = {s.key: s.phase_delta for s in CATALOGUE if s.phase_delta}
VERL_KEYS = {s.verl: f"{s.key}/max" for s in CATALOGUE if s.verl}
"""verl's name -> the aggregated key whose value it carries, with the corrected meaning (DESIGN.md)."""


def spec(key: str) -> KeySpec | None:
    """The catalogue entry of a per-rank key, phase keys included; None for the caller's own keys."""
    found = SPECS.get(key)
    if found is None and key.startswith(PHASE_PREFIX):
        suffix = key.rsplit("/", 1)[-1]
        found = next((s for s in PHASE_CATALOGUE if s.key == suffix), None)
    return found


def key_of(field: str) -> str:
    """The per-rank key made from :class:`~rankmem.core.records.WindowBytes` field ``field``: code that means
    one quantity (the report's headroom line, ``rankmem train``'s progress line) names it by its field."""
    for entry in CATALOGUE:
        if entry.field == field:
            return entry.key
    raise KeyError(f"no catalogue key is made from WindowBytes.{field}")


def worse(key: str) -> Worse:
    """``low`` where a low value is the danger (headroom, available memory); ``high`` otherwise."""
    found = SPECS.get(key)
    return found.worse if found is not None else "high"


def worst_stat(key: str) -> str:
    """``max`` or ``min``: which aggregate of ``key`` holds the worst rank."""
    return "min" if worse(key) == "low" else "max"


def is_memory_key(key: str) -> bool:
    """A step-level memory key (phase keys and the caller's scalars aside)."""
    return key.startswith(MEMORY_PREFIX) and not key.startswith(PHASE_PREFIX)


def phase_key(phase: str, suffix: str) -> str:
    return f"{PHASE_PREFIX}{phase}/{suffix}"


def phase_names(keys: Iterable[str]) -> list[str]:
    """The phases named in ``keys`` (``mem/phase/P/...``), sorted."""
    return sorted({k.split("/")[2] for k in keys if k.startswith(PHASE_PREFIX) and k.count("/") >= 3})


_WINDOW_FIELDS = tuple((s.key, s.field, s.unit == "GiB") for s in CATALOGUE)


ATTRIBUTION_FIELDS = {"device_" + part: part for part in
                      ("nontorch", "siblings", "descendants", "foreign", "unattributed")}
"""WindowBytes field -> the part of a device split (:class:`rankmem.probe.attribution.Attribution`)."""


def window_metrics(w: WindowBytes, out: dict[str, float]) -> None:
    """Add the step-level keys of ``w`` to ``out`` (GiB or counts); unavailable figures are left out."""
    for key, name, gib in _WINDOW_FIELDS:
        value = getattr(w, name)
        if value is not None:
            out[key] = value / GIB if gib else float(value)


def phase_metrics(name: str, p: PhaseBytes, out: dict[str, float]) -> None:
    """Add phase ``name``'s keys ``mem/phase/<name>/...`` of ``p`` to ``out``."""
    prefix = f"{PHASE_PREFIX}{name}/"
    for s in PHASE_CATALOGUE:
        value = getattr(p, s.field)
        if value is not None:
            out[prefix + s.key] = value / GIB


def verl_metrics(aggregated: Mapping[str, float]) -> dict[str, float]:
    """verl's ``perf/*`` names for the matching aggregated keys that exist."""
    return {verl: aggregated[ours] for verl, ours in VERL_KEYS.items() if ours in aggregated}


def phase_of_peak(key: str, value: float, rank_values: Mapping[str, float | None]) -> str | None:
    """The phase that set one rank's step peak ``value`` of ``key``.

    The ``P`` whose ``mem/phase/P/<phase_suffix>`` equals it; :data:`OUTSIDE_PHASES` when phases were
    measured but none holds it; None when ``key`` has no phase counterpart or ``rank_values`` (that
    rank's values on that step by key, None or NaN where absent; other keys ignored) has no phase keys.
    The one rule for ``rankmem report`` and ``rankmem train``'s summary, so both name the same phase.
    """
    suffix = PHASE_SUFFIX.get(key)
    if suffix is None:
        return None
    measured = False
    best: tuple[float, str] | None = None
    for k, v in rank_values.items():
        if not k.startswith(PHASE_PREFIX):
            continue
        measured = True
        # The step peak is the max of its phases' peaks and the gaps: bit-equal when a phase set it.
        if (k.endswith("/" + suffix) and v is not None and math.isfinite(v)
                and math.isclose(v, value, rel_tol=1e-9, abs_tol=1e-12) and (best is None or v > best[0])):
            best = (v, k[len(PHASE_PREFIX) : -len(suffix) - 1])
    if not measured:
        return None
    return best[1] if best else OUTSIDE_PHASES
