"""Typed records of one rank's memory, in bytes. ``None`` means the platform cannot give the value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class HostReading:
    """This process and its node, read at one instant. All sizes in bytes."""

    rss: int | None
    """Resident set size of this process."""
    peak_rss: int | None
    """Max RSS since the last peak reset (or since process start when ``peak_rss_is_lifetime``)."""
    peak_rss_is_lifetime: bool
    """True where the kernel cannot reset the high-water mark, so ``peak_rss`` is a lifetime peak."""
    children_rss: int | None
    """Summed RSS of descendant processes (dataloader workers); shared pages count once per child."""
    node_total: int | None
    """``MemTotal`` of the node."""
    node_available: int | None
    """``MemAvailable`` of the node."""
    cgroup_used: int | None
    """Memory charged to this process's cgroup, only when a limit applies."""
    cgroup_limit: int | None
    """The cgroup's memory limit; ``None`` when unlimited."""

    @property
    def node_used(self) -> int | None:
        if self.node_total is None or self.node_available is None:
            return None
        return self.node_total - self.node_available


@dataclass(frozen=True, slots=True)
class DeviceReading:
    """One accelerator as this process sees it. All sizes in bytes, counters cumulative."""

    allocated: int | None
    """Bytes held by live tensors."""
    reserved: int | None
    """Bytes the caching allocator holds."""
    peak_allocated: int | None
    """Max allocated since the last peak reset."""
    peak_reserved: int | None
    """Max reserved since the last peak reset."""
    used: int | None
    """Device-wide ``total - free``: other processes, the CUDA context and NCCL buffers included."""
    total: int | None
    """Device capacity."""
    alloc_retries: int | None
    """Cumulative count of allocations retried after freeing the cache."""
    ooms: int | None
    """Cumulative count of out-of-memory errors raised by the allocator."""


@dataclass(frozen=True, slots=True)
class MemorySample:
    """A one-off local reading, as returned by :func:`rankmem.sample`."""

    host: HostReading
    device: DeviceReading | None
    """``None`` when no device backend is in use (CPU-only)."""
    device_name: str
    """``"cuda"``, ``"npu"``, ``"xpu"`` or ``"none"``."""

    def to_metrics(self) -> dict[str, float]:
        """The reading as rankmem metric keys (GiB values), unavailable figures left out."""
        from rankmem._metrics import sample_metrics

        return sample_metrics(self)


@dataclass(slots=True)
class RankInfo:
    """Who a rank is: gathered once, at the first collect, into the run log header."""

    rank: int
    local_rank: int
    host: str
    pid: int
    device: str
    """The backend (``cuda``/``npu``/``xpu``/``none``) and the device's name where known."""
    peak_rss_scope: str
    """``"window"`` where the host peak resets per window, ``"lifetime"`` where it cannot, ``"sampled"``
    off Linux (the max of the RSS read at window edges)."""


@dataclass(slots=True)
class RunHeader:
    """What the run log's first line holds."""

    world_size: int
    ranks: list[RankInfo]
    config: dict[str, Any] = field(default_factory=dict)
    started: float = 0.0
    """Unix time of the first collect."""


@dataclass(slots=True)
class StepRecord:
    """One logged step, as every sink receives it on the logging rank."""

    step: int
    time: float
    """Unix time of the collect."""
    metrics: dict[str, float]
    """Aggregated keys (``K/max``, ``K/min``, ``K/mean``, ``K/max_rank``) and verl-compatible keys."""
    ranks: dict[str, list[float | None]]
    """Per-rank values of every per-rank key ``K``, indexed by rank; ``None`` where a rank lacks it."""
