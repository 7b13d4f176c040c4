"""Device memory through the torch device module of one backend (cuda, npu, xpu), chosen once.

Reading must never create a CUDA context: ``current_device()``, ``mem_get_info()`` and the peak reset
each initialise CUDA, the last two on the current device (cuda:0 before the rank's ``set_device``). So
the device is resolved at every read, and read only once the training code has initialised the backend
and a primary context exists on the current device; until then the figures are ``None``.

One call per read supplies every allocator figure: the nested stats of the C binding
(``torch._C._cuda_memoryStats``, or ``memory_stats_as_nested_dict``), cheaper than ``memory_stats()``,
which flattens ~120 keys on every call; modules with neither fall back to it. On CUDA a second call
reads the caching *host* allocator (``torch._C._cuda_hostMemoryStats``), where torch has it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rankmem.core.guard import attempt
from rankmem.core.records import DeviceReading
from rankmem.core.warnings import WarnOnce
from rankmem.errors import RankmemError

BACKENDS = ("cuda", "npu", "xpu")

_BEFORE_INIT = DeviceReading(None, None, None, None, None, None, None, None, before_init=True)
_EMPTY: dict[str, Any] = {}


@dataclass(frozen=True, slots=True)
class _Hooks:
    """The allocator's private entry points, found once per module; ``None`` where absent.

    For the real ``torch.cuda`` they live in ``torch._C`` and ``torch.cuda.memory``; any other module
    (``rankmem.testing.FakeCuda``) offers them as methods of its own under the names below.
    """

    has_context: Callable[[int], Any] | None
    """``torch._C._cuda_hasPrimaryContext(index)``: asks the driver without creating a context."""
    nested_stats: Callable[[int], Any] | None
    """``torch._C._cuda_memoryStats(index)``: the allocator's stats as nested dicts, unflattened."""
    attach_oom_observer: Callable[[Callable[..., None]], Any] | None
    """``torch._C._cuda_attach_out_of_memory_observer(fn)``."""
    record_history: Callable[..., Any] | None
    """``torch.cuda.memory._record_memory_history``."""
    snapshot: Callable[[], Any] | None
    """``torch.cuda.memory._snapshot``."""
    set_metadata: Callable[[str], Any] | None
    """``torch.cuda.memory._set_memory_metadata``: a tag carried by the history entries that follow."""
    host_stats: Callable[[], Any] | None = None
    """``torch._C._cuda_hostMemoryStats()``: the pinned (host) allocator's stats as nested dicts."""


def _find_hooks(module: Any) -> _Hooks:
    if getattr(module, "__name__", None) == "torch.cuda":
        # torch is imported already (module is its attribute); a CPU build lacks every binding.
        binding, memory = sys.modules["torch"]._C, getattr(module, "memory", None)
        return _Hooks(
            has_context=getattr(binding, "_cuda_hasPrimaryContext", None),
            nested_stats=getattr(binding, "_cuda_memoryStats", None),
            attach_oom_observer=getattr(binding, "_cuda_attach_out_of_memory_observer", None),
            record_history=getattr(memory, "_record_memory_history", None),
            snapshot=getattr(memory, "_snapshot", None),
            set_metadata=getattr(memory, "_set_memory_metadata", None),
            host_stats=getattr(binding, "_cuda_hostMemoryStats", None),
        )
    return _Hooks(
        has_context=getattr(module, "_has_primary_context", None),
        # npu and xpu have the public nested form; it checks initialisation and the index first.
        nested_stats=getattr(module, "memory_stats_as_nested_dict", None),
        attach_oom_observer=getattr(module, "_attach_out_of_memory_observer", None),
        record_history=getattr(module, "_record_memory_history", None),
        snapshot=getattr(module, "_snapshot", None),
        set_metadata=getattr(module, "_set_memory_metadata", None),
        host_stats=getattr(module, "host_memory_stats_as_nested_dict", None),
    )


def pinned_figures(stats: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """``(current, peak)`` bytes of page-locked host memory the caching host allocator holds (blocks in
    use and cached alike: all of it is pinned), from torch's host-allocator stats, nested
    (``_cuda_hostMemoryStats()``: ``{"allocated_bytes": {"current": .., "peak": ..}}``) or flat
    (``torch.cuda.host_memory_stats()``: ``"allocated_bytes.current"``). rankmem never resets the
    peak (torch's reset is process-wide), so it is a lifetime peak. ``None`` for a figure not given."""
    nested = stats.get("allocated_bytes")
    if isinstance(nested, Mapping):
        return _int(nested.get("current")), _int(nested.get("peak"))
    return _int(stats.get("allocated_bytes.current")), _int(stats.get("allocated_bytes.peak"))


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


class DeviceBackend:
    """Reads one device through a torch device module (``torch.cuda`` or anything with its API).

    The device read is the *current* one at each read (``index`` fixes it instead), so a backend built
    before ``set_device(local_rank)`` reads this rank's device. ``reset_peak_memory_stats`` resets peaks for
    the whole process; the monitor keeps its own running max, so a reset by us never shortens its windows.
    """

    def __init__(self, name: str, module: Any, index: int | None = None) -> None:
        self.name = name
        self.module = module
        self._index = index
        self.peaks_resettable = hasattr(module, "reset_peak_memory_stats")
        self._warn_once = WarnOnce()
        self._hooks = _find_hooks(module)
        self._is_initialized = getattr(module, "is_initialized", None)
        self._flat_stats = getattr(module, "memory_stats", None)
        self._mem_get_info = getattr(module, "mem_get_info", None)
        self._with_context: set[int] = set()
        self.last_index: int | None = None
        """The device the last read found (with a context): what another thread reads, its own current
        device being another (CUDA's current device is per thread)."""

    # ---- which device, if any --------------------------------------------------------------------
    def initialised(self) -> bool:
        """Whether the backend is initialised; a module without lazy initialisation always is."""
        if self._is_initialized is None:
            return True
        return bool(attempt(self._is_initialized, default=False))

    def current_index(self) -> int | None:
        """The device to read now, or ``None`` where reading it would initialise the backend or create
        a context. ``current_device()`` runs ``_lazy_init``, so it is called only once initialised."""
        if not self.initialised():
            return None
        index = self._index if self._index is not None else attempt(self.module.current_device, default=None)
        if index is None:
            return None
        index = int(index)
        if index in self._with_context or self._hooks.has_context is None:
            self.last_index = index
            return index
        if not attempt(self._hooks.has_context, index, default=False):
            return None
        self._with_context.add(index)  # a primary context lives as long as the process: ask once
        self.last_index = index
        return index

    def device_name(self) -> str:
        """``cuda:1 NVIDIA H200`` once initialised (the name needs no context); ``cuda`` before."""
        if not self.initialised():
            return self.name
        index = self._index if self._index is not None else attempt(self.module.current_device, default=None)
        if index is None:
            return self.name
        model = attempt(self.module.get_device_name, index, default=None)
        return f"{self.name}:{index}" if model is None else f"{self.name}:{index} {model}"

    def device_uuid(self) -> str | None:
        """The device's UUID as ``nvidia-smi -L`` and DCGM spell it (``GPU-...``); None where the backend has
        none, or before it is initialised (``get_device_properties`` needs no context, but an index)."""
        if not self.initialised():
            return None
        index = self._index if self._index is not None else attempt(self.module.current_device, default=None)
        get = getattr(self.module, "get_device_properties", None)
        props = None if index is None or get is None else attempt(get, index, default=None)
        uuid = getattr(props, "uuid", None)
        if uuid is None:
            return None
        text = str(uuid)
        return text if text.startswith(("GPU-", "MIG-")) else "GPU-" + text

    # ---- window edges ------------------------------------------------------------------------------
    def reset_peaks(self) -> None:
        if not self.peaks_resettable:
            return
        index = self.current_index()
        if index is None:  # nothing allocated yet; a reset would create a context (or raise, before init)
            return
        # AttributeError/RuntimeError on a build without the backend compiled in.
        if attempt(self.module.reset_peak_memory_stats, index, default=False) is False:
            self.peaks_resettable = False
            self._warn_once("reset", f"{self.name}: cannot reset peak memory stats; device peaks are lifetime peaks")

    def _stats(self, index: int) -> tuple[dict[str, Any], bool]:
        """The allocator's stats and whether they are nested; ``{}`` when none can be read."""
        nested = self._hooks.nested_stats
        read = nested if nested is not None else self._flat_stats
        stats = None if read is None else attempt(read, index, default=None)
        return (stats if isinstance(stats, dict) else _EMPTY), nested is not None or read is None

    def read(self) -> DeviceReading:
        """Allocator figures and device-wide usage of the current device: one stats call and one
        ``mem_get_info``. All ``None`` (``before_init``) while the device has no context."""
        index = self.current_index()
        if index is None:
            return _BEFORE_INIT
        stats, nested = self._stats(index)
        if nested:
            allocated = stats.get("allocated_bytes", _EMPTY).get("all", _EMPTY)
            reserved = stats.get("reserved_bytes", _EMPTY).get("all", _EMPTY)
            inactive = stats.get("inactive_split_bytes", _EMPTY).get("all", _EMPTY)
            figures = (
                allocated.get("current"), reserved.get("current"), allocated.get("peak"),
                reserved.get("peak"), inactive.get("current"),
            )
        else:
            figures = (
                stats.get("allocated_bytes.all.current"), stats.get("reserved_bytes.all.current"),
                stats.get("allocated_bytes.all.peak"), stats.get("reserved_bytes.all.peak"),
                stats.get("inactive_split_bytes.all.current"),
            )
        free = total = None
        info = None if self._mem_get_info is None else attempt(self._mem_get_info, index, default=None)
        if info is not None:
            free, total = int(info[0]), int(info[1])
        pinned = pinned_peak = None
        if self._hooks.host_stats is not None:
            host = attempt(self._hooks.host_stats, default=None)
            if isinstance(host, Mapping):
                pinned, pinned_peak = pinned_figures(host)
        return DeviceReading(
            allocated=_int(figures[0]),
            reserved=_int(figures[1]),
            peak_allocated=_int(figures[2]),
            peak_reserved=_int(figures[3]),
            used=None if total is None or free is None else total - free,
            total=total,
            alloc_retries=_int(stats.get("num_alloc_retries")),
            ooms=_int(stats.get("num_ooms")),
            inactive_split=_int(figures[4]),
            free=free,
            pinned=pinned,
            pinned_peak=pinned_peak,
        )

    # ---- forensics (CUDA allocators that have them; no-ops elsewhere) -------------------------------
    # Each acts only once the backend is initialised: before, the allocator has no per-device state to
    # attach to (observers attached before init crash: pytorch#107330), and callers retry later.
    def attach_oom_observer(self, fn: Callable[[int, int, int, int], None]) -> bool:
        """Have the allocator call ``fn(device, alloc_bytes, device_total, device_free)`` when an
        allocation fails, before it raises (torch names the third argument ``device_allocated``; it
        holds the capacity, or the allowed maximum under a memory fraction). False where unsupported
        or not initialised yet."""
        attach = self._hooks.attach_oom_observer
        if attach is None or not self.initialised():
            return False
        return attempt(attach, fn, default=False) is not False

    def record_history(self, max_entries: int, clear: bool = False) -> bool:
        """Keep the last ``max_entries`` allocator events with Python stacks of the allocations, for
        :meth:`snapshot` (``clear``: the ring emptied first); ``0`` stops recording. False where
        unsupported or not initialised yet."""
        record = self._hooks.record_history
        if record is None or not self.initialised():
            return False
        if max_entries > 0:
            clearing = {"clear_history": True} if clear else {}  # a torch without the option still records
            done = attempt(record, enabled="all", context="alloc", stacks="python", max_entries=int(max_entries),
                           default=False, **clearing)
        else:
            done = attempt(record, enabled=None, default=False)
        return done is not False

    def set_metadata_hook(self) -> Callable[[str], Any] | None:
        """``_set_memory_metadata`` (tags the history entries that follow), where this torch has it."""
        return self._hooks.set_metadata

    def snapshot(self) -> dict[str, Any] | None:
        """The allocator's state (``{"segments": [...], "device_traces": [[...], ...]}``, torch's
        ``_snapshot()`` format, which pytorch.org/memory_viz reads), or ``None``."""
        take = self._hooks.snapshot
        if take is None or not self.initialised():
            return None
        snap = attempt(take, default=None)
        return snap if isinstance(snap, dict) else None

    def segments(self, top: int = 5) -> list[dict[str, Any]]:
        """The ``top`` live segments of the current device holding the most allocated bytes, largest
        first, each summarised small enough for an event line. ``[]`` where none can be read."""
        index = self.current_index()
        raw = self.live_segments() if index is not None else None
        if raw is None:
            return []
        live = [
            s for s in raw
            if isinstance(s, dict) and s.get("device", index) == index and int(s.get("allocated_size", 0)) > 0
        ]
        live.sort(key=lambda s: (int(s.get("allocated_size", 0)), int(s.get("total_size", 0))), reverse=True)
        return [_segment_summary(s) for s in live[: max(top, 0)]]

    def live_segments(self) -> list[Any] | None:
        """The allocator's segments and their blocks, without the history (which, recording, gets a
        ``snapshot`` entry that marks this moment); None where they cannot be read."""
        take = getattr(self.module, "memory_snapshot", None)
        if take is not None:
            raw = attempt(_segments_only, take, default=None)
        else:
            raw = (self.snapshot() or _EMPTY).get("segments")
        return raw if isinstance(raw, list) else None


def _segments_only(memory_snapshot: Callable[..., Any]) -> Any:
    try:
        return memory_snapshot(include_traces=False)  # skips copying the history: only segments are needed
    except TypeError:  # a torch without the option
        return memory_snapshot()


def _segment_summary(segment: dict[str, Any]) -> dict[str, Any]:
    blocks = [b for b in segment.get("blocks", ()) if b.get("state") == "active_allocated"]
    largest = max(blocks, key=lambda b: int(b.get("size", 0)), default=None)
    frames = [] if largest is None else largest.get("frames") or []
    return {
        "device": segment.get("device"),
        "address": segment.get("address"),
        "total_size": segment.get("total_size"),
        "allocated_size": segment.get("allocated_size"),
        "active_size": segment.get("active_size"),
        "segment_type": segment.get("segment_type"),
        "allocated_blocks": len(blocks),
        # Where the largest block came from, innermost first (present when history is recorded).
        "largest_block_frames": [f"{f.get('filename')}:{f.get('line')} {f.get('name')}" for f in frames[:3]],
    }


def select_backend(device: str = "auto", device_module: Any = None) -> DeviceBackend | None:
    """Pick the backend once. ``device``: ``auto``, ``cuda``, ``npu``, ``xpu``, or ``cpu``/``none``.

    ``device_module`` replaces the torch module of the named backend (``cuda`` when ``device`` is
    ``auto``): the way tests pass in a fake ``torch.cuda``. Choosing calls ``is_available()``, which
    does not initialise CUDA.
    """
    if device in ("cpu", "none"):
        return None
    if device not in ("auto", *BACKENDS):
        raise RankmemError(f"device must be one of auto, cuda, npu, xpu, cpu, none; got {device!r}")
    if device_module is not None:
        return DeviceBackend("cuda" if device == "auto" else device, device_module)
    try:
        import torch
    except ImportError:
        if device != "auto":
            raise RankmemError(f"device={device!r} needs torch: pip install 'rankmem[torch]'") from None
        return None
    names = BACKENDS if device == "auto" else (device,)
    for name in names:
        module = getattr(torch, name, None)
        if module is None:
            continue
        available = bool(attempt(module.is_available, default=False))
        if available or device != "auto":
            # An explicitly named backend is used even when unavailable: its figures then read None.
            return DeviceBackend(name, module)
    return None
