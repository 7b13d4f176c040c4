"""Metric names: where bytes become ``_gib`` keys. The key table in README.md documents each one."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rankmem._units import GIB

if TYPE_CHECKING:
    from rankmem._records import MemorySample

PHASE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")

# verl's engine-worker names, with the corrected meaning (DESIGN.md): window peaks and process RSS,
# worst rank. verl's "gb" divides by 1024**3, so these are GiB too.
VERL_KEYS = {
    "perf/max_memory_allocated_gb": "mem/device/peak_allocated_gib/max",
    "perf/max_memory_reserved_gb": "mem/device/peak_reserved_gib/max",
    "perf/cpu_memory_used_gb": "mem/host/rss_gib/max",
}


@dataclass(slots=True)
class WindowBytes:
    """One rank's figures for one window (a step, or what ran since the last collect), in bytes."""

    rss: int | None = None
    peak_rss: int | None = None
    children_rss: int | None = None
    node_used: int | None = None
    node_available: int | None = None
    cgroup_used: int | None = None
    cgroup_limit: int | None = None
    allocated: int | None = None
    reserved: int | None = None
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    used: int | None = None
    total: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None
    lifetime_peak_rss: int | None = None
    lifetime_peak_reserved: int | None = None


@dataclass(slots=True)
class PhaseBytes:
    """One phase inside a step; a phase run twice in a step keeps the max peaks and summed deltas."""

    peak_rss: int | None = None
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    rss_delta: int | None = None
    allocated_delta: int | None = None


def _put(out: dict[str, float], key: str, value: int | None) -> None:
    if value is not None:
        out[key] = value / GIB


def window_metrics(w: WindowBytes, out: dict[str, float]) -> None:
    """Add the step-level keys of ``w`` to ``out``; unavailable figures are left out."""
    _put(out, "mem/host/rss_gib", w.rss)
    _put(out, "mem/host/peak_rss_gib", w.peak_rss)
    _put(out, "mem/host/lifetime_peak_rss_gib", w.lifetime_peak_rss)
    _put(out, "mem/host/children_rss_gib", w.children_rss)
    _put(out, "mem/node/used_gib", w.node_used)
    _put(out, "mem/node/available_gib", w.node_available)
    _put(out, "mem/node/cgroup_used_gib", w.cgroup_used)
    _put(out, "mem/node/cgroup_limit_gib", w.cgroup_limit)
    _put(out, "mem/device/allocated_gib", w.allocated)
    _put(out, "mem/device/reserved_gib", w.reserved)
    _put(out, "mem/device/peak_allocated_gib", w.peak_allocated)
    _put(out, "mem/device/peak_reserved_gib", w.peak_reserved)
    _put(out, "mem/device/lifetime_peak_reserved_gib", w.lifetime_peak_reserved)
    _put(out, "mem/device/used_gib", w.used)
    _put(out, "mem/device/total_gib", w.total)
    other = None
    if w.used is not None and w.reserved is not None:
        other = max(w.used - w.reserved, 0)
        _put(out, "mem/device/other_gib", other)
    if w.total is not None and w.peak_reserved is not None and other is not None:
        _put(out, "mem/device/headroom_gib", w.total - (w.peak_reserved + other))
    if w.alloc_retries is not None:
        out["mem/device/alloc_retries"] = float(w.alloc_retries)
    if w.ooms is not None:
        out["mem/device/ooms"] = float(w.ooms)


def phase_metrics(name: str, p: PhaseBytes, out: dict[str, float]) -> None:
    prefix = f"mem/phase/{name}/"
    _put(out, prefix + "peak_rss_gib", p.peak_rss)
    _put(out, prefix + "rss_delta_gib", p.rss_delta)
    _put(out, prefix + "peak_allocated_gib", p.peak_allocated)
    _put(out, prefix + "peak_reserved_gib", p.peak_reserved)
    _put(out, prefix + "allocated_delta_gib", p.allocated_delta)


def verl_metrics(aggregated: dict[str, float]) -> dict[str, float]:
    """verl's three names for the matching aggregated keys that exist."""
    return {verl: aggregated[ours] for verl, ours in VERL_KEYS.items() if ours in aggregated}


def sample_metrics(s: MemorySample) -> dict[str, float]:
    h, d = s.host, s.device
    w = WindowBytes(
        rss=h.rss,
        peak_rss=h.peak_rss,
        children_rss=h.children_rss,
        node_used=h.node_used,
        node_available=h.node_available,
        cgroup_used=h.cgroup_used,
        cgroup_limit=h.cgroup_limit,
    )
    if d is not None:
        w.allocated, w.reserved = d.allocated, d.reserved
        w.peak_allocated, w.peak_reserved = d.peak_allocated, d.peak_reserved
        w.used, w.total = d.used, d.total
    out: dict[str, float] = {}
    window_metrics(w, out)
    return out
