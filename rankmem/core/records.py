"""Typed records of one rank's memory, in bytes. ``None`` means the platform cannot give the value."""

from __future__ import annotations

from collections.abc import Sequence
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
    """Summed RSS of descendant processes (dataloader workers); pages shared with this process count once
    per child, so forked workers are overstated (see ``children_uss``)."""
    node_total: int | None
    """``MemTotal`` of the node."""
    node_available: int | None
    """``MemAvailable`` of the node."""
    cgroup_used: int | None
    """Memory charged to this process's cgroup, only when a limit applies."""
    cgroup_limit: int | None
    """The cgroup's memory limit; ``None`` when unlimited."""
    children_uss: int | None = None
    """Summed private memory (USS) of descendant processes: what the workers add to this process's
    footprint. Read every ``children_refresh_s`` seconds on a thread, so up to that old."""
    cgroup_working_set: int | None = None
    """``cgroup_used`` minus the cgroup's inactive file cache: what the OOM killer weighs."""

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
    inactive_split: int | None = None
    """Bytes in cached blocks split off in-use segments: reserved, free, yet not releasable (fragmentation)."""
    free: int | None = None
    """Device-wide free bytes as the driver reports them (``total - used``)."""
    pinned: int | None = None
    """Page-locked host memory the backend's caching host allocator holds (CUDA), in use and cached."""
    pinned_peak: int | None = None
    """Max of ``pinned`` since the process started (rankmem never resets it)."""
    before_init: bool = False
    """True when the read was skipped because the device had no context yet (reading would create one):
    every figure is ``None``, and the allocator had necessarily allocated nothing and counted nothing."""


@dataclass(slots=True)
class WindowBytes:
    """One rank's figures for one window (a step, or what ran since the last collect), in bytes.

    Built by :meth:`of` from readings (for :func:`rankmem.sample` and for each window's end); the
    windows then put their own peaks, deltas and lifetime maxima in.
    """

    rss: int | None = None
    peak_rss: int | None = None
    children_rss: int | None = None
    node_used: int | None = None
    node_available: int | None = None
    cgroup_used: int | None = None
    cgroup_limit: int | None = None
    children_uss: int | None = None
    cgroup_working_set: int | None = None
    node_age_s: float | None = None
    """Seconds since the node, cgroup and children figures were read (rankmem.probe.nodewatch)."""
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
    inactive_split: int | None = None
    pinned: int | None = None
    lifetime_peak_pinned: int | None = None
    # Device used by owner (rankmem.probe.attribution), from the last NVML split: up to its refresh old.
    device_nontorch: int | None = None
    device_siblings: int | None = None
    device_descendants: int | None = None
    device_foreign: int | None = None
    device_unattributed: int | None = None
    engine_residue: int | None = None
    """The descendants' device memory in the split taken at the end of the last ``sleep`` phase (or the
    start of a ``wake``): what the engine holds asleep."""

    @classmethod
    def of(cls, host: HostReading | None, device: DeviceReading | None) -> WindowBytes:
        """The figures of ``host`` and ``device`` as read at one instant (peaks as the readings hold
        them, counters left out: a window's events are deltas, which only the windows know)."""
        w = cls()
        if host is not None:
            w.rss, w.peak_rss, w.children_rss = host.rss, host.peak_rss, host.children_rss
            w.add_node(host)
        if device is not None:
            w.allocated, w.reserved = device.allocated, device.reserved
            w.peak_allocated, w.peak_reserved = device.peak_allocated, device.peak_reserved
            w.used, w.total = device.used, device.total
            w.inactive_split = device.inactive_split
            w.pinned, w.lifetime_peak_pinned = device.pinned, device.pinned_peak
        return w

    def add_node(self, host: HostReading) -> None:
        """The node, cgroup and children figures of a slow host read."""
        self.node_used, self.node_available = host.node_used, host.node_available
        self.cgroup_used, self.cgroup_limit = host.cgroup_used, host.cgroup_limit
        self.cgroup_working_set = host.cgroup_working_set
        self.children_rss, self.children_uss = host.children_rss, host.children_uss

    @property
    def other(self) -> int | None:
        """``used - reserved``, clamped at 0: device memory outside this process's allocator."""
        if self.used is None or self.reserved is None:
            return None
        return max(self.used - self.reserved, 0)

    @property
    def headroom(self) -> int | None:
        """``total - (peak_reserved + other)``: how close the window came to running out."""
        other = self.other
        if self.total is None or self.peak_reserved is None or other is None:
            return None
        return self.total - (self.peak_reserved + other)


@dataclass(slots=True)
class PhaseBytes:
    """One phase inside a step; a phase run twice in a step keeps the max peaks and summed deltas."""

    peak_rss: int | None = None
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    rss_delta: int | None = None
    allocated_delta: int | None = None
    mb_tokens: float | None = None
    """Tokens of the phase's heaviest micro-batch (:meth:`rankmem.Monitor.micro_batch`); None: not told."""
    mb_sequences: float | None = None
    """Sequences in that heaviest micro-batch."""
    mb_sq_tokens: float | None = None
    """Sum over that micro-batch's sequences of the squared sequence length (tokens**2): attention's term."""
    tokens: float | None = None
    """Tokens over all the phase's micro-batches."""
    micro_batches: float | None = None
    """How many micro-batches the phase was told about."""
    device_descendants: int | None = None
    """The descendants' device memory when last seen inside this phase (an engine asleep or not)."""
    peak_rss_rise: int | None = None
    """``peak_rss`` minus RSS at the start of the run of the phase that holds that peak: what the phase
    itself raised (0 where it only held memory from before)."""
    peak_allocated_rise: int | None = None
    peak_reserved_rise: int | None = None
    # What filled the peak (rankmem.anatomy, docs/anatomy.md): with Monitor.track() only.
    anatomy_params: int | None = None
    anatomy_optimizer: int | None = None
    anatomy_grads_low: int | None = None
    anatomy_grads_high: int | None = None
    anatomy_activations: int | None = None
    anatomy_slack: int | None = None
    anatomy_other: int | None = None


@dataclass(slots=True)
class RankInfo:
    """Who a rank is: gathered once, at the first collect, into the run log header."""

    rank: int
    local_rank: int | None
    """None where a run log read back does not say (so for :attr:`pid`)."""
    host: str
    """The host name; ``""`` where a run log read back does not say (that rank is then a node of its own)."""
    pid: int | None
    device: str
    """The backend (``cuda``/``npu``/``xpu``/``none``) and the device's name where known; ``""`` where a
    run log read back does not say."""
    peak_rss_scope: str
    """``"window"`` where the host peak resets per window, ``"edges"`` where rankmem leaves it alone
    (``peak_source="edges"``: exact where a window set a new lifetime high, else its edges' max),
    ``"lifetime"`` where it cannot reset, ``"sampled"`` off Linux (the max of the RSS read at window edges);
    ``""`` where a run log read back does not say."""
    device_uuid: str | None = None
    """The device's UUID as NVIDIA's tools spell it (``GPU-...``, the DCGM exporter's ``UUID`` label),
    where the backend gives one."""


@dataclass(slots=True)
class RunHeader:
    """What the run log's first line holds: built by the Monitor at the first collect, written by
    :mod:`rankmem.runlog.header`, and read back into the same record by the offline tools
    (:func:`rankmem.runlog.header.header_from_json`). The fields after :attr:`run_id` are what the
    file said about itself: None on a header built in process (the writer writes its own)."""

    world_size: int
    ranks: list[RankInfo]
    config: dict[str, Any] = field(default_factory=dict)
    started: float | None = 0.0
    """Unix time of the first collect; None where a run log read back does not say."""
    run_id: str | None = None
    """The run's identity (:func:`rankmem.core.rundir.current_run_id` of the logging rank), which every
    file of the run carries."""
    schema: int | None = None
    """The run log's schema, as read."""
    detail: str | None = None
    """The side file's name, as the header gives it (readers find it by the log's own name)."""
    rankmem_version: str | None = None
    """The rankmem that wrote the log (the header's ``rankmem``), as read."""
    torch_version: str | None = None
    """The torch of the writing process (the header's ``torch``), as read; None without torch."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Header fields this version does not know (a newer writer's), as read."""
    unread: dict[str, Any] = field(default_factory=dict)
    """Known fields whose value was not of their type (a ``config`` that is a list, a NaN ``started``),
    as read: the attribute holds its default."""


def per_rank_lists(keys: Sequence[str], matrix: Any) -> dict[str, list[float | None]]:
    """Per key, each rank's value of a ranks x keys float matrix; ``None`` where it is NaN (absent)."""
    cols = matrix.T.tolist()
    return {k: [None if v != v else v for v in col] for k, col in zip(keys, cols, strict=True)}


@dataclass(slots=True)
class StepRecord:
    """One logged step, as every sink receives it on the logging rank."""

    step: int
    time: float
    """Unix time of the collect."""
    metrics: dict[str, float]
    """Aggregated keys (``K/max``, ``K/min``, ``K/mean``, ``K/max_rank``, ``K/min_rank``) and verl-compatible keys."""
    ranks: dict[str, list[float | None]] = field(default_factory=dict)
    """Per-rank values of every per-rank key ``K``, indexed by rank; ``None`` where a rank lacks it.
    Empty when the record carries them as :attr:`matrix` instead (see :meth:`columns`)."""
    keys: Sequence[str] = ()
    """The per-rank keys, sorted, when :attr:`matrix` is given or the collect carried no detail."""
    matrix: Any = None
    """ranks x :attr:`keys` float64 array (NaN where absent), or None: what the monitor hands over, so
    that the run log never builds the per-rank lists."""

    def columns(self) -> dict[str, list[float | None]]:
        """:attr:`ranks`, built from :attr:`matrix` when only that is given."""
        if self.ranks or self.matrix is None:
            return self.ranks
        return per_rank_lists(self.keys, self.matrix)

    def key_names(self) -> Sequence[str]:
        """The per-rank keys: :attr:`keys`, else those of :attr:`ranks`, else read off the aggregates."""
        if self.keys or self.ranks:
            return self.keys or tuple(self.ranks)
        return sorted(k[: -len("/max")] for k in self.metrics if k.endswith("/max"))
