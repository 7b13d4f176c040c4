"""A faithful fake of the ``torch.cuda`` memory API, for tests on machines without a GPU.

Pass it in through the public API (``Monitor(device_module=FakeCuda())``), never by patching torch.
It models what rankmem reads: a caching allocator whose reserved memory grows in 2 MiB segments and
is kept on free; peaks that ``reset_peak_memory_stats`` sets to the current values while the
``num_alloc_retries`` / ``num_ooms`` counters stay cumulative (as in torch); a retry that frees the
cache before an OOM; and device-wide usage from ``mem_get_info`` that includes a CUDA context and
memory held by other processes (a colocated inference engine).
"""

from __future__ import annotations

from typing import Any

from rankmem._units import GIB, MIB

_SEGMENT = 2 * MIB


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class FakeOutOfMemoryError(RuntimeError):
    """Raised like ``torch.OutOfMemoryError`` (a RuntimeError subclass) when the fake device is full."""


class FakeCuda:
    """One fake device. ``malloc``/``free`` stand for tensor allocation; the rest mirrors ``torch.cuda``."""

    def __init__(self, total: int = 16 * GIB, context: int = 300 * MIB, name: str = "Fake GPU") -> None:
        self.total = total
        self.context = context
        """Bytes of the CUDA context: used on the device, invisible to the allocator."""
        self.other_process = 0
        """Bytes held by other processes on the device (a colocated vLLM/SGLang engine)."""
        self.name = name
        self._allocated = 0
        self._reserved = 0
        self._peak_allocated = 0
        self._peak_reserved = 0
        self._retries = 0
        self._ooms = 0
        self._segments: dict[int, list[int]] = {}  # handle -> [segment bytes, bytes in use]
        self._next = 0

    # ---- simulation ---------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` as a tensor would; returns a handle for :meth:`free`.

        A request is served by the smallest cached free segment that fits (one block per segment, a
        simplification of torch's block splitting); otherwise a new segment is reserved from the
        device. When the device is too full, the cache is released and the reservation retried once
        (``num_alloc_retries``); if that fails too, ``num_ooms`` counts it and the error is raised.
        """
        size = _round_up(max(nbytes, 1), 512)
        free_segments = [h for h, (seg, used) in self._segments.items() if used == 0 and seg >= size]
        if free_segments:
            handle = min(free_segments, key=lambda h: self._segments[h][0])
        else:
            seg = _round_up(size, _SEGMENT)
            if self._device_free() < seg:
                self._retries += 1
                self.empty_cache()
                if self._device_free() < seg:
                    self._ooms += 1
                    raise FakeOutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes")
            self._next += 1
            handle = self._next
            self._segments[handle] = [seg, 0]
            self._reserved += seg
        self._segments[handle][1] = size
        self._allocated += size
        self._peak_allocated = max(self._peak_allocated, self._allocated)
        self._peak_reserved = max(self._peak_reserved, self._reserved)
        return handle

    def free(self, handle: int) -> None:
        """Free a block; its segment stays reserved (cached) until :meth:`empty_cache`."""
        self._allocated -= self._segments[handle][1]
        self._segments[handle][1] = 0

    def _device_free(self) -> int:
        return self.total - self.context - self.other_process - self._reserved

    # ---- the torch.cuda API -------------------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def get_device_name(self, device: Any = None) -> str:
        return self.name

    def memory_stats(self, device: Any = None) -> dict[str, Any]:
        return {
            "allocated_bytes.all.current": self._allocated,
            "allocated_bytes.all.peak": self._peak_allocated,
            "reserved_bytes.all.current": self._reserved,
            "reserved_bytes.all.peak": self._peak_reserved,
            "active_bytes.all.current": self._allocated,
            "num_alloc_retries": self._retries,
            "num_ooms": self._ooms,
        }

    def memory_allocated(self, device: Any = None) -> int:
        return self._allocated

    def memory_reserved(self, device: Any = None) -> int:
        return self._reserved

    def max_memory_allocated(self, device: Any = None) -> int:
        return self._peak_allocated

    def max_memory_reserved(self, device: Any = None) -> int:
        return self._peak_reserved

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        # Like torch: peaks drop to the current values; the retry/OOM counters are not reset.
        self._peak_allocated = self._allocated
        self._peak_reserved = self._reserved

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return self._device_free(), self.total

    def empty_cache(self) -> None:
        for handle, (seg, used) in list(self._segments.items()):
            if used == 0:
                self._reserved -= seg
                del self._segments[handle]
