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
HELD = "(held from before: no phase raised it)"


@dataclass(frozen=True, slots=True)
class KeySpec:
    """One per-rank metric key and everything rankmem knows about it."""

    key: str
    field: str
    """The :class:`~rankmem.core.records.WindowBytes` attribute (bytes, a count or seconds) it is made from."""
    unit: Literal["GiB", "count", "s"]
    worse: Worse = "high"
    """Which end is dangerous: ``high`` for usage and peaks, ``low`` for headroom and available memory."""
    phase_suffix: str | None = None
    """For a step peak, the per-phase key ``mem/phase/P/<suffix>`` that holds the same peak inside P."""
    rise_suffix: str | None = None
    """For a step peak, the per-phase key ``mem/phase/P/<rise_suffix>``: how far P rose to its own peak
    from where it began (peak minus the value at P's start). A phase that only held the peak rose 0."""
    noise: float = 0.0
    """GiB: two readings of this key closer than this are the same to the probe (page and allocator
    granularity, the interpreter's own churn between edges): the tolerance of "reached the peak" and
    "rose"."""
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
    refreshed: bool = False
    """Read on a cadence of its own (the node thread, NVML's process list), not at each collect: the
    collects between two readings repeat the last one. The leak verdicts judge it on its refreshes."""

    def worst_stat(self) -> str:
        """``max`` or ``min``: the aggregate that holds the worst rank's value."""
        return "min" if self.worse == "low" else "max"


CATALOGUE: tuple[KeySpec, ...] = (
    KeySpec("mem/host/rss_gib", "rss", "GiB", leak=True, phase_delta="rss_delta_gib", headline="rss", plot=True,
            verl="perf/cpu_memory_used_gb"),
    # RSS between two edges moves by up to ~1 MiB with nothing of the user's happening (pymalloc arenas,
    # rankmem's own dicts): 2 MiB apart is "the same" to this probe. The allocator's figures are exact.
    KeySpec("mem/host/peak_rss_gib", "peak_rss", "GiB", phase_suffix="peak_rss_gib", rise_suffix="peak_rss_rise_gib",
            noise=2 / 1024, headline="peak_rss", summary=True, plot=True),
    KeySpec("mem/host/lifetime_peak_rss_gib", "lifetime_peak_rss", "GiB"),
    # Summed child RSS counts pages forked workers share with this process once per worker; the console
    # and the summary show what the workers add (USS). RSS stays the leak baseline: it is read every
    # collect, and a worker's private growth shows in it all the same.
    KeySpec("mem/host/children_rss_gib", "children_rss", "GiB", leak=True, refreshed=True),
    KeySpec("mem/host/children_uss_gib", "children_uss", "GiB", headline="children", summary=True,
            refreshed=True),
    KeySpec("mem/host/pinned_gib", "pinned", "GiB"),
    KeySpec("mem/host/lifetime_peak_pinned_gib", "lifetime_peak_pinned", "GiB"),
    KeySpec("mem/node/used_gib", "node_used", "GiB", refreshed=True),
    KeySpec("mem/node/available_gib", "node_available", "GiB", worse="low", refreshed=True),
    KeySpec("mem/node/cgroup_used_gib", "cgroup_used", "GiB", refreshed=True),
    KeySpec("mem/node/cgroup_limit_gib", "cgroup_limit", "GiB", refreshed=True),
    KeySpec("mem/node/cgroup_working_set_gib", "cgroup_working_set", "GiB", refreshed=True),
    KeySpec("mem/device/allocated_gib", "allocated", "GiB", leak=True, phase_delta="allocated_delta_gib"),
    KeySpec("mem/device/reserved_gib", "reserved", "GiB"),
    KeySpec("mem/device/peak_allocated_gib", "peak_allocated", "GiB", phase_suffix="peak_allocated_gib",
            rise_suffix="peak_allocated_rise_gib", summary=True, verl="perf/max_memory_allocated_gb"),
    KeySpec("mem/device/peak_reserved_gib", "peak_reserved", "GiB", phase_suffix="peak_reserved_gib",
            rise_suffix="peak_reserved_rise_gib", headline="dev_peak_res", summary=True, plot=True,
            verl="perf/max_memory_reserved_gb"),
    KeySpec("mem/device/lifetime_peak_reserved_gib", "lifetime_peak_reserved", "GiB"),
    KeySpec("mem/device/inactive_split_gib", "inactive_split", "GiB"),
    KeySpec("mem/device/used_gib", "used", "GiB", summary=True),
    KeySpec("mem/device/other_gib", "other", "GiB"),
    KeySpec("mem/device/total_gib", "total", "GiB"),
    KeySpec("mem/device/headroom_gib", "headroom", "GiB", worse="low", headline="dev_headroom", summary=True),
    # `other` by owner (docs/device-attribution.md): NVML's processes on the device, every ~10 s.
    KeySpec("mem/device/nontorch_gib", "device_nontorch", "GiB", refreshed=True),
    KeySpec("mem/device/siblings_gib", "device_siblings", "GiB", refreshed=True),
    KeySpec("mem/device/descendants_gib", "device_descendants", "GiB", refreshed=True),
    KeySpec("mem/device/foreign_gib", "device_foreign", "GiB", refreshed=True),
    KeySpec("mem/device/unattributed_gib", "device_unattributed", "GiB", refreshed=True),
    # What a colocated engine (this rank's descendants) still holds once asleep: a growing residue is a
    # leak the engine's own logs show once per sleep at best (NeMo-RL#2619: 4.11 -> 11.57 -> 25 GiB).
    KeySpec("mem/device/engine_residue_gib", "engine_residue", "GiB", leak=True),
    KeySpec("mem/device/alloc_retries", "alloc_retries", "count"),
    KeySpec("mem/device/ooms", "ooms", "count"),
    # How old the node, cgroup and children figures are: read on a thread of their own (probe/nodewatch.py).
    KeySpec("mem/node/age_s", "node_age_s", "s"),
)

PHASE_CATALOGUE: tuple[KeySpec, ...] = (
    KeySpec("peak_rss_gib", "peak_rss", "GiB"),
    KeySpec("rss_delta_gib", "rss_delta", "GiB"),
    KeySpec("peak_allocated_gib", "peak_allocated", "GiB"),
    KeySpec("peak_reserved_gib", "peak_reserved", "GiB"),
    KeySpec("allocated_delta_gib", "allocated_delta", "GiB"),
    # The work beside the memory (Monitor.micro_batch): what the advice's memory model is fitted against.
    KeySpec("heaviest_mb_tokens", "mb_tokens", "count"),
    KeySpec("heaviest_mb_sequences", "mb_sequences", "count"),
    KeySpec("heaviest_mb_sq_tokens", "mb_sq_tokens", "count"),
    KeySpec("tokens", "tokens", "count"),
    KeySpec("micro_batches", "micro_batches", "count"),
    KeySpec("descendants_gib", "device_descendants", "GiB"),
)
"""Per phase ``P``: the keys ``mem/phase/P/<key>`` (a :class:`~rankmem.core.records.PhaseBytes` field each)."""

PHASE_RISE_CATALOGUE: tuple[KeySpec, ...] = (
    KeySpec("peak_rss_rise_gib", "peak_rss_rise", "GiB"),
    KeySpec("peak_allocated_rise_gib", "peak_allocated_rise", "GiB"),
    KeySpec("peak_reserved_rise_gib", "peak_reserved_rise", "GiB"),
)
"""Per phase ``P``: how far P rose to its own peak (``mem/phase/P/peak_*_rise_gib``), what tells the phase
that *raised* a step's peak from those that only held it (:func:`peak_phase`). Documented in
docs/phase-attribution.md rather than README's key table: they serve the verdicts, not the reader."""

ANATOMY_PARTS = ("params", "optimizer", "grads_low", "grads_high", "activations", "slack", "other")
ANATOMY_CATALOGUE: tuple[KeySpec, ...] = tuple(KeySpec(f"anatomy/{part}_gib", "anatomy_" + part, "GiB")
                                               for part in ANATOMY_PARTS)
"""Per phase ``P``: ``mem/phase/P/anatomy/<part>_gib``, the split of P's peak (docs/anatomy.md)."""

WORK_FIELDS = ("mb_tokens", "mb_sequences", "mb_sq_tokens", "tokens", "micro_batches")
"""The :class:`~rankmem.core.records.PhaseBytes` fields that count work, not bytes."""


def work_key(phase: str, field: str) -> str:
    """Phase ``phase``'s key of work field ``field`` (one of :data:`WORK_FIELDS`)."""
    return phase_key(phase, next(s.key for s in PHASE_CATALOGUE if s.field == field))

SPECS: dict[str, KeySpec] = {s.key: s for s in CATALOGUE}
LEAK_KEYS = tuple(s.key for s in CATALOGUE if s.leak)
REFRESHED_KEYS = frozenset(s.key for s in CATALOGUE if s.refreshed)
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
        suffix = key.split("/", 3)[-1]
        found = next((s for s in _PHASE_KEYS if s.key == suffix), None)
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


def is_freshness_key(key: str) -> bool:
    """A key that says how old other figures are (seconds: ``mem/node/age_s``), not how much memory:
    the report keeps it out of its worst-key tables and gives it a line of its own."""
    found = spec(key)
    return found is not None and found.unit == "s"


def phase_key(phase: str, suffix: str) -> str:
    return f"{PHASE_PREFIX}{phase}/{suffix}"


def phase_names(keys: Iterable[str]) -> list[str]:
    """The phases named in ``keys`` (``mem/phase/P/...``), sorted."""
    return sorted({k.split("/")[2] for k in keys if k.startswith(PHASE_PREFIX) and k.count("/") >= 3})


_PHASE_KEYS = (*PHASE_CATALOGUE, *PHASE_RISE_CATALOGUE, *ANATOMY_CATALOGUE)
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
    for s in _PHASE_KEYS:
        value = getattr(p, s.field)
        if value is not None:
            out[prefix + s.key] = value / GIB if s.unit == "GiB" else float(value)


def rank_metrics(w: WindowBytes, phases: Mapping[str, PhaseBytes]) -> dict[str, float]:
    """One rank's keys for a closed window: the step-level keys of ``w``, then each phase's."""
    out: dict[str, float] = {}
    window_metrics(w, out)
    for name, p in phases.items():
        phase_metrics(name, p, out)
    return out


def verl_metrics(aggregated: Mapping[str, float]) -> dict[str, float]:
    """verl's ``perf/*`` names for the matching aggregated keys that exist."""
    return {verl: aggregated[ours] for verl, ours in VERL_KEYS.items() if ours in aggregated}


Verdict = Literal["rose", "held", "tie", "outside"]


@dataclass(frozen=True, slots=True)
class PeakPhase:
    """Which phase made one rank's step peak, as every verdict (report, summary, plot, HTML) says it.

    ``rose``: ``phases`` holds the one phase in which memory rose to the peak. ``tie``: several rose to it
    within the probe's noise (``phases`` names them). ``held``: phases reached the peak but none raised it
    (it was held from before: the allocator kept it); ``phases`` names those that held it. ``outside``: no
    phase reached it (it was set between phases).
    """

    verdict: Verdict
    phases: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """The phase's name when one raised the peak; otherwise a parenthesised verdict that names no
        single phase."""
        if self.verdict == "rose":
            return self.phases[0]
        if self.verdict == "tie":
            return f"(tie: {', '.join(self.phases)} rose to it)"
        if self.verdict == "held":
            return HELD
        return OUTSIDE_PHASES


def peak_phase(key: str, value: float, rank_values: Mapping[str, float | None]) -> PeakPhase | None:
    """The phase(s) in which one rank's step peak ``value`` of ``key`` was reached by a rise.

    ``rank_values`` is that rank's values on that step by key (None or NaN where absent). A phase reached
    the peak when its own peak is within the key's :attr:`KeySpec.noise` of ``value``, and raised it when it
    also rose more than that noise from where it began; logs without the rise keys fall back to the phases
    whose peak equals ``value``. None when ``key`` has no phase counterpart or the step has no phase keys.
    The one rule of ``rankmem report``, ``rankmem train``'s summary, the plot's markers and the HTML page.
    """
    entry = SPECS.get(key)
    if entry is None or entry.phase_suffix is None:
        return None
    peaks: dict[str, float] = {}
    rises: dict[str, float] = {}
    measured = False
    for k, v in rank_values.items():
        if not k.startswith(PHASE_PREFIX):
            continue
        measured = True
        if v is None or not math.isfinite(v):
            continue
        phase, _, suffix = k[len(PHASE_PREFIX):].rpartition("/")
        if suffix == entry.phase_suffix:
            peaks[phase] = v
        elif suffix == entry.rise_suffix:
            rises[phase] = v
    if not measured:
        return None
    if not rises:  # an older log: the bit-equal rule, and a tie where several phases hold the peak
        reached = sorted(p for p, v in peaks.items() if math.isclose(v, value, rel_tol=1e-9, abs_tol=1e-12))
        if not reached:
            return PeakPhase("outside")
        return PeakPhase("rose" if len(reached) == 1 else "tie", tuple(reached))
    reached = sorted(p for p, v in peaks.items() if v >= value - entry.noise - 1e-12)
    if not reached:
        return PeakPhase("outside")
    rose = tuple(p for p in reached if rises.get(p, 0.0) > entry.noise)
    if not rose:
        return PeakPhase("held", tuple(reached))
    return PeakPhase("rose" if len(rose) == 1 else "tie", rose)


def phase_of_peak(key: str, value: float, rank_values: Mapping[str, float | None]) -> str | None:
    """:func:`peak_phase`'s label: the phase that raised the peak, or a verdict naming none; None when
    not applicable."""
    found = peak_phase(key, value, rank_values)
    return None if found is None else found.label
