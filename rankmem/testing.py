"""A faithful fake of the ``torch.cuda`` memory API, for tests on machines without a GPU.

Pass it in through the public API (``Monitor(device_module=FakeCuda())``), never by patching torch.
It models what rankmem reads, and the side effects of torch that could hurt a rank:

- **Lazy initialisation.** ``is_initialized()`` is false until ``init()``, ``current_device()``,
  ``set_device()``, ``get_device_name()``, ``mem_get_info()`` or an allocation; before it
  ``memory_stats()`` is ``{}`` and ``reset_peak_memory_stats(i)`` raises as torch does.
- **Contexts.** ``set_device(i)``, ``mem_get_info(i)`` and an allocation on ``i`` create device ``i``'s
  primary context (``context`` bytes); ``contexts_created`` counts them per device.
- **A caching allocator per device** with torch's pools and rounding (one block per segment); freed
  segments stay reserved until ``empty_cache()``; peak resets set peaks to the current values.
- **The OOM path as torch takes it**: release the cache and retry once (``num_alloc_retries``), then
  ``num_ooms``, an ``oom`` history entry, the observers called with ``(device, alloc_size,
  device_total, device_free)``, and :class:`FakeOutOfMemoryError` with torch's message.
- **History and snapshots** in the format of ``torch.cuda.memory._snapshot()``.

Real CUDA has some of this only in private entry points. Here they are methods, under the names
rankmem's backend looks for on a module that is not ``torch.cuda``:

==================================  =================================================
``FakeCuda``                        real CUDA (where rankmem finds it)
==================================  =================================================
``_has_primary_context(i)``         ``torch._C._cuda_hasPrimaryContext(i)``
``memory_stats_as_nested_dict(i)``  ``torch._C._cuda_memoryStats(i)`` (same dict)
``_attach_out_of_memory_observer``  ``torch._C._cuda_attach_out_of_memory_observer``
``_record_memory_history``          ``torch.cuda.memory._record_memory_history``
``_snapshot()``                     ``torch.cuda.memory._snapshot()``
==================================  =================================================

:class:`FakeNvml` is the matching fake of ``pynvml``: ``Monitor(device_module=cuda,
nvml_module=FakeNvml(cuda))``.
"""

from __future__ import annotations

import collections
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rankmem._fake_nvml import FakeNvml, NVMLError
from rankmem.core.units import GIB, MIB

__all__ = ["FakeCuda", "FakeNvml", "FakeOutOfMemoryError", "NVMLError", "format_size"]

_SMALL_REQUEST = 1 * MIB  # torch's kSmallSize: requests up to this go to the small pool
_SMALL_SEGMENT = 2 * MIB  # kSmallBuffer
_MID_SEGMENT = 20 * MIB  # kLargeBuffer, for requests under kMinLargeAlloc
_MIN_LARGE_ALLOC = 10 * MIB
_ROUND_LARGE = 2 * MIB
_STAT_NAMES = (
    "allocated", "allocated_bytes", "segment", "reserved_bytes", "active", "active_bytes",
    "inactive_split", "inactive_split_bytes", "requested_bytes",
)
_POOLS = ("all", "large_pool", "small_pool")
_ADDRESS_BASE = 0x7F0000000000  # device i's segments start at _ADDRESS_BASE + (i << _DEVICE_SPAN)
_DEVICE_SPAN = 36  # 64 GiB of addresses per device; a segment's address is also its handle
_HISTORY_LEVELS = {None: 0, "state": 1, "alloc": 2, "all": 3}
_OOM_HINT = (
    " If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    " to avoid fragmentation.  See documentation for Memory Management "
    " (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _segment_size(pool: str, size: int) -> int:
    """The segment torch's allocator reserves for a request of ``size`` bytes that no cached one holds."""
    if pool == "small_pool":
        return _SMALL_SEGMENT
    return _MID_SEGMENT if size < _MIN_LARGE_ALLOC else _round_up(size, _ROUND_LARGE)


def format_size(n: int) -> str:
    """Bytes as torch's allocator writes them in its messages: ``2.00 GiB``, ``512.00 MiB``."""
    if n <= 1024:
        return f"{n} bytes"
    if n <= MIB:
        return f"{n / 1024:.2f} KiB"
    if n <= GIB:
        return f"{n / MIB:.2f} MiB"
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class _Properties:
    name: str
    total_memory: int
    uuid: str


class FakeOutOfMemoryError(RuntimeError):
    """Raised like ``torch.OutOfMemoryError`` (a RuntimeError subclass) when the fake device is full."""


class _Stat:
    """One allocator statistic, as torch keeps it: current, peak, and cumulative increase/decrease."""

    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def update(self, amount: int) -> None:
        self.current += amount
        if amount >= 0:
            self.allocated += amount
        else:
            self.freed -= amount
        self.peak = max(self.peak, self.current)

    def as_dict(self) -> dict[str, int]:
        return {"current": self.current, "peak": self.peak, "allocated": self.allocated, "freed": self.freed}


class _Segment:
    __slots__ = ("address", "size", "pool", "used", "requested", "frames")

    def __init__(self, address: int, size: int, pool: str) -> None:
        self.address, self.size, self.pool = address, size, pool
        self.used = 0  # bytes of the one block in use at the segment's start; 0: the segment is free
        self.requested = 0
        self.frames: list[dict[str, Any]] = []


class _Allocator:
    """One device's caching allocator."""

    def __init__(self, base: int) -> None:
        self.metadata = ""  # torch.cuda.memory._set_memory_metadata: tags the trace entries that follow
        self.stats = {name: {pool: _Stat() for pool in _POOLS} for name in _STAT_NAMES}
        self.retries = 0
        self.ooms = 0
        self.segments: dict[int, _Segment] = {}  # handle (its address) -> segment
        self.next_address = base
        self.recording = False  # trace entries kept (enabled="all")
        self.stacks = 0  # whose stacks are kept: 1 live blocks ("state"), 2 + allocations ("alloc"), 3 + frees
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=1)
        self.observers: list[Callable[[int, int, int, int], object]] = []

    def update(self, name: str, pool: str, amount: int) -> None:
        stat = self.stats[name]
        stat["all"].update(amount)
        stat[pool].update(amount)

    def current(self, name: str) -> int:
        return self.stats[name]["all"].current

    def nested(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: {pool: s.as_dict() for pool, s in stat.items()} for name,
                               stat in self.stats.items()}
        out.update(
            num_alloc_retries=self.retries, num_ooms=self.ooms, num_sync_all_streams=0,
            num_device_alloc=self.stats["segment"]["all"].allocated,
            num_device_free=self.stats["segment"]["all"].freed, max_split_size=-1,
            oversize_allocations=_Stat().as_dict(), oversize_segments=_Stat().as_dict(),
        )
        return out

    def malloc(self, nbytes: int, free: Callable[[], int], out_of_memory: Callable[[int, int], None]) -> int:
        """torch's request path (``DeviceCachingAllocator::malloc``): the smallest cached free segment of
        the request's pool that fits, else a new segment; when the device (``free()`` bytes) cannot hold
        it, the cache is released and the reservation retried once; then ``out_of_memory(size,
        alloc_size)``, which raises. Returns the segment's handle (its address)."""
        size = _round_up(max(nbytes, 1), 512)
        pool = "small_pool" if size <= _SMALL_REQUEST else "large_pool"
        segment = self.cached(pool, size)
        if segment is None:
            alloc_size = _segment_size(pool, size)
            if free() < alloc_size:
                self.retries += 1
                self.release_cache()
                if free() < alloc_size:
                    out_of_memory(size, alloc_size)
            segment = self.new_segment(pool, alloc_size)
        self.occupy(segment, size, nbytes)
        return segment.address

    def cached(self, pool: str, size: int) -> _Segment | None:
        """The smallest free cached segment of ``pool`` that holds ``size``, if any."""
        fits = [s for s in self.segments.values() if s.used == 0 and s.pool == pool and s.size >= size]
        return min(fits, key=lambda s: s.size) if fits else None

    def new_segment(self, pool: str, alloc_size: int) -> _Segment:
        segment = self.segments[self.next_address] = _Segment(self.next_address, alloc_size, pool)
        self.next_address += alloc_size
        self.update("segment", pool, 1)
        self.update("reserved_bytes", pool, alloc_size)
        self.trace(2, {"action": "segment_alloc", "addr": segment.address, "size": alloc_size})
        return segment

    def occupy(self, segment: _Segment, size: int, nbytes: int) -> None:
        """Put one block of ``size`` bytes (``nbytes`` requested) at the start of a free segment."""
        segment.used, segment.requested = size, nbytes
        segment.frames = _frames() if self.stacks >= 1 else []
        self._count_block(segment, +1)
        self.trace(2, {"action": "alloc", "addr": segment.address, "size": size})

    def vacate(self, segment: _Segment) -> None:
        """Free the segment's block; the segment stays reserved (cached)."""
        self._count_block(segment, -1)
        for action in ("free_requested", "free_completed"):
            self.trace(3, {"action": action, "addr": segment.address, "size": segment.used})
        segment.used = segment.requested = 0
        segment.frames = []

    def _count_block(self, segment: _Segment, sign: int) -> None:
        size, pool = segment.used, segment.pool
        for name, amount in (("allocated", 1), ("active", 1), ("allocated_bytes", size), ("active_bytes", size),
                             ("requested_bytes", segment.requested)):
            self.update(name, pool, sign * amount)
        if segment.size > size:
            self.update("inactive_split", pool, sign)
            self.update("inactive_split_bytes", pool, sign * (segment.size - size))

    def release_cache(self) -> list[int]:
        """Give every free segment back to the device (their handles are then unknown); their handles."""
        released = [h for h, s in self.segments.items() if s.used == 0]
        for handle in released:
            segment = self.segments.pop(handle)
            self.update("segment", segment.pool, -1)
            self.update("reserved_bytes", segment.pool, -segment.size)
            self.trace(3, {"action": "segment_free", "addr": segment.address, "size": segment.size})
        return released

    def out_of_memory(self, index: int, size: int, alloc_size: int, total: int, free: int) -> None:
        """Count and trace a failed reservation and tell the observers, before the error is raised."""
        self.trace(2, {"action": "oom", "size": size, "device_free": free})
        self.ooms += 1
        for observer in list(self.observers):  # torch calls them without the allocator lock, before raising
            observer(index, alloc_size, total, free)

    def reset_peaks(self) -> None:
        for stat in self.stats.values():
            for s in stat.values():
                s.peak = s.current

    def record_history(self, enabled: str | None, context: str | None, max_entries: int, clear: bool) -> None:
        self.recording = enabled == "all"
        self.stacks = _HISTORY_LEVELS[context] if enabled is not None else 0
        if enabled is None or clear or self.history.maxlen != max_entries:
            self.history = collections.deque(maxlen=max_entries)  # a ring of max_entries

    def trace(self, level: int, entry: dict[str, Any]) -> None:
        """Keep ``entry`` when recording; with the stack when ``context`` covers its ``level``."""
        if self.recording:
            entry.setdefault("stream", 0)
            entry["frames"] = _frames() if self.stacks >= level else []
            entry["time_us"] = int(time.time() * 1e6)
            entry["user_metadata"] = self.metadata
            self.history.append(entry)


def _frames(limit: int = 16) -> list[dict[str, Any]]:
    """The Python stack of the allocating code, innermost first, as torch records it."""
    frames: list[dict[str, Any]] = []
    frame = sys._getframe(1)
    while frame is not None and len(frames) < limit:
        code = frame.f_code
        if code.co_filename != __file__:
            frames.append({"filename": code.co_filename, "line": frame.f_lineno, "name": code.co_name})
        frame = frame.f_back  # type: ignore[assignment]
    return frames


class FakeCuda:
    """Fake CUDA devices: ``malloc``/``free`` stand for tensor allocation; the rest mirrors ``torch.cuda``.

    ``total``, ``context`` and ``other_process`` apply to every device alike.
    """

    def __init__(
        self, total: int = 16 * GIB, context: int = 300 * MIB, name: str = "Fake GPU", devices: int = 1
    ) -> None:
        if devices < 1:
            raise ValueError(f"devices must be >= 1, got {devices}")
        self.total = total
        self.context = context
        """Bytes of a CUDA context: used on its device, invisible to the allocator."""
        self.other_process = 0
        """Bytes held by other processes on each device (a colocated vLLM/SGLang engine)."""
        self.name = name
        self.contexts_created: dict[int, int] = {}
        """Primary contexts created, per device index (a context lives until the process ends)."""
        self._initialized = False
        self._current = 0
        self._devices = [_Allocator(_ADDRESS_BASE + (i << _DEVICE_SPAN)) for i in range(devices)]

    # ---- initialisation and contexts ------------------------------------------------------------------
    def _lazy_init(self) -> None:
        self._initialized = True  # torch's _cuda_init: no context of its own

    def _ensure_context(self, index: int) -> None:
        _check_index(index, len(self._devices))
        if not self.contexts_created.get(index):
            self.contexts_created[index] = self.contexts_created.get(index, 0) + 1

    def _has_primary_context(self, index: int) -> bool:
        """``torch._C._cuda_hasPrimaryContext``: asks the driver, creates nothing, initialises nothing."""
        if not 0 <= index < len(self._devices):
            raise RuntimeError(f"hasPrimaryContext expects a valid device index, but got device_index={index}")
        return bool(self.contexts_created.get(index))

    # ---- simulation ---------------------------------------------------------------------------------
    def malloc(self, nbytes: int, device: int | None = None) -> int:
        """Allocate ``nbytes`` as a tensor would (on the current device); returns a handle for :meth:`free`.

        Initialises CUDA and creates the device's context, as a first tensor does. Raises
        :class:`FakeOutOfMemoryError` when the device cannot hold it, after one retry without the cache.
        """
        self._lazy_init()
        index = self._current if device is None else device
        self._ensure_context(index)
        return self._devices[index].malloc(nbytes, lambda: self._device_free(index),
                                           lambda size, alloc_size: self._out_of_memory(index, size, alloc_size))

    def free(self, handle: int) -> None:
        """Free a block; its segment stays reserved (cached) until :meth:`empty_cache`."""
        dev = self._devices[(handle - _ADDRESS_BASE) >> _DEVICE_SPAN]
        dev.vacate(dev.segments[handle])

    def _device_free(self, index: int) -> int:
        context = self.context if self.contexts_created.get(index) else 0
        return self.total - context - self.other_process - self._devices[index].current("reserved_bytes")

    def _out_of_memory(self, index: int, size: int, alloc_size: int) -> None:
        dev, free = self._devices[index], self._device_free(index)
        dev.out_of_memory(index, size, alloc_size, self.total, free)
        raise FakeOutOfMemoryError(_oom_message(index, alloc_size, self.total, free, self.other_process,
                                                self.context, dev))

    # ---- the torch.cuda API -------------------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self._initialized

    def init(self) -> None:
        self._lazy_init()

    def device_count(self) -> int:
        return len(self._devices)  # torch counts devices without initialising

    def current_device(self) -> int:
        self._lazy_init()
        return self._current

    def set_device(self, device: Any) -> None:
        index = _device_index(device, self.current_device)
        if index >= 0:
            self._lazy_init()
            self._ensure_context(index)
            self._current = index

    def get_device_properties(self, device: Any = None) -> _Properties:
        """torch's ``_CudaDeviceProperties``, the fields rankmem reads: ``name``, ``total_memory``, ``uuid``
        (CUDA's UUID; ``str()`` of it has no ``GPU-`` prefix, as torch's ``_CUuuid``)."""
        index = _device_index(device, self.current_device)
        self._lazy_init()
        _check_index(index, len(self._devices))
        return _Properties(self.name, self.total, f"{index:08x}-fa4e-4c0d-8a11-00000000cafe")

    def get_device_name(self, device: Any = None) -> str:
        _device_index(device, self.current_device)
        self._lazy_init()  # device properties come after initialisation
        return self.name

    def memory_stats_as_nested_dict(self, device: Any = None) -> dict[str, Any]:
        if not self._initialized:  # checked before the device index is resolved: initialises nothing
            return {}
        index = _device_index(device, self.current_device)
        _check_index(index, len(self._devices))
        return self._devices[index].nested()

    def memory_stats(self, device: Any = None) -> dict[str, Any]:
        """The nested stats flattened to ``a.b.c`` keys and sorted, as torch does in Python."""
        flat: list[tuple[str, Any]] = []
        _flatten("", self.memory_stats_as_nested_dict(device), flat)
        flat.sort()
        return dict(flat)

    def memory_allocated(self, device: Any = None) -> int:
        return int(self.memory_stats(device).get("allocated_bytes.all.current", 0))

    def memory_reserved(self, device: Any = None) -> int:
        return int(self.memory_stats(device).get("reserved_bytes.all.current", 0))

    def max_memory_allocated(self, device: Any = None) -> int:
        return int(self.memory_stats(device).get("allocated_bytes.all.peak", 0))

    def max_memory_reserved(self, device: Any = None) -> int:
        return int(self.memory_stats(device).get("reserved_bytes.all.peak", 0))

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        index = _device_index(device, self.current_device)  # no device: current_device(), which initialises
        if not self._initialized:
            raise RuntimeError(f"Invalid device argument {index}: did you call init?")
        _check_index(index, len(self._devices))
        self._devices[index].reset_peaks()

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        index = _device_index(device, self.current_device)
        self._lazy_init()  # torch.cuda.cudart() initialises
        self._ensure_context(index)  # cudaMemGetInfo on the device: its context, created if absent
        return self._device_free(index), self.total

    def empty_cache(self) -> None:
        if self._initialized:
            for dev in self._devices:
                dev.release_cache()

    def memory_snapshot(self, mempool_id: Any = None, include_traces: bool = True) -> list[dict[str, Any]]:
        return list(self._snapshot()["segments"])

    # ---- private entry points (see the module docstring for their torch names) ------------------------
    def _attach_out_of_memory_observer(self, observer: Callable[[int, int, int, int], object]) -> None:
        if self._initialized:  # before, there is no per-device allocator to keep it: lost, as in torch
            for dev in self._devices:
                dev.observers.append(observer)

    def _record_memory_history(
        self,
        enabled: str | bool | None = "all",
        context: str | None = "all",
        stacks: str = "all",
        max_entries: int = sys.maxsize,
        device: Any = None,
        clear_history: bool = False,
        **ignored: Any,
    ) -> None:
        if isinstance(enabled, bool):  # torch's legacy form
            enabled = "all" if enabled else None
        if enabled not in _HISTORY_LEVELS or context not in _HISTORY_LEVELS:
            raise ValueError(f"enabled and context must be None, 'state', 'alloc' or 'all'; got {enabled!r}, "
                             f"{context!r}")
        if not self._initialized:  # lost, as in torch
            return
        for dev in self._devices:
            dev.record_history(enabled, context, max(int(max_entries), 1), clear_history)

    def _set_memory_metadata(self, metadata: str) -> None:
        for dev in self._devices:
            dev.metadata = str(metadata)

    def _snapshot(self, device: Any = None) -> dict[str, Any]:
        if not self._initialized:
            return {"segments": [], "device_traces": []}
        segments = [_segment_dict(index, segment) for index, dev in enumerate(self._devices)
                    for segment in sorted(dev.segments.values(), key=lambda s: s.address)]
        for dev in self._devices:  # as torch marks, in the history, every snapshot taken while recording
            active = sum(s.used for s in dev.segments.values())
            dev.trace(9, {"action": "snapshot", "addr": 0, "size": active})
        return {"segments": segments, "device_traces": [list(dev.history) for dev in self._devices]}


def _flatten(prefix: str, value: Any, into: list[tuple[str, Any]]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, into)
    else:
        into.append((prefix, value))


def _oom_message(index: int, alloc_size: int, total: int, free: int, other_process: int, context: int,
                 dev: _Allocator) -> str:
    """torch's out-of-memory message, figure for figure."""
    allocated, reserved = dev.current("allocated_bytes"), dev.current("reserved_bytes")
    others = f"Process 4242 has {format_size(other_process)} memory in use. " if other_process else ""
    return (f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU {index} has a total capacity "
            f"of {format_size(total)} of which {format_size(free)} is free. {others}Including non-PyTorch "
            f"memory, this process has {format_size(context + reserved)} memory in use. Of the allocated "
            f"memory {format_size(allocated)} is allocated by PyTorch, and {format_size(reserved - allocated)} "
            f"is reserved by PyTorch but unallocated.{_OOM_HINT}")


def _segment_dict(index: int, segment: _Segment) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = []
    if segment.used:
        blocks.append({"address": segment.address, "size": segment.used, "requested_size": segment.requested,
                       "state": "active_allocated", "frames": segment.frames})
    if segment.size > segment.used:
        blocks.append({"address": segment.address + segment.used, "size": segment.size - segment.used,
                       "requested_size": 0, "state": "inactive", "frames": []})
    return {
        "device": index, "address": segment.address, "total_size": segment.size,
        "allocated_size": segment.used, "active_size": segment.used, "requested_size": segment.requested,
        "stream": 0, "segment_type": "small" if segment.pool == "small_pool" else "large",
        "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks,
    }


def _check_index(index: int, count: int) -> None:
    if not 0 <= index < count:
        raise RuntimeError(f"Invalid device argument {index}: did you call init?")


def _device_index(device: Any, current: Callable[[], int]) -> int:
    """torch's ``_get_device_index(device, optional=True)``: no device means the current one."""
    if device is None:
        return current()
    if isinstance(device, str):
        return int(device.split(":")[1]) if ":" in device else current()
    index = getattr(device, "index", device)
    return current() if index is None else int(index)
