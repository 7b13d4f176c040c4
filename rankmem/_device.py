"""Device memory through the torch device module of one backend (cuda, npu, xpu), chosen once.

One ``memory_stats()`` call per read supplies every allocator figure: ``memory_allocated()`` and friends
each build that same dict again, so calling them separately would cost four dicts instead of one.
On a CPU-only build ``memory_stats()`` is ``{}``, the peak reset raises and ``mem_get_info`` raises:
those figures are ``None`` (unavailable), never 0.
"""

from __future__ import annotations

from typing import Any

from rankmem._records import DeviceReading
from rankmem.errors import RankmemError, WarnOnce

BACKENDS = ("cuda", "npu", "xpu")


class DeviceBackend:
    """Reads one device through a torch device module (``torch.cuda`` or anything with its API).

    Peaks are reset with ``reset_peak_memory_stats``, which resets them for everyone in the process:
    another caller that resets them shortens our window (the monitor keeps its own running max over
    the pieces it sees, so a reset by us never shortens a window of ours).
    """

    def __init__(self, name: str, module: Any, index: int | None = None) -> None:
        self.name = name
        self.module = module
        # None follows the current device: a Monitor built before set_device(local_rank) still reads
        # this rank's device, not device 0.
        self._index = index
        self.peaks_resettable = hasattr(module, "reset_peak_memory_stats")
        self._warn_once = WarnOnce()

    @property
    def index(self) -> int:
        if self._index is not None:
            return self._index
        try:
            return int(self.module.current_device())
        except Exception:
            return 0

    @property
    def torch_device(self) -> tuple[str, int]:
        """``(device_type, index)`` for tensors of device-only collectives (NCCL, HCCL)."""
        return self.name, self.index

    def _ready(self) -> bool:
        # Before the backend is initialised, mem_get_info() and the peak reset would create a context
        # on the current device (device 0 before set_device): hundreds of MiB on the wrong GPU.
        is_initialized = getattr(self.module, "is_initialized", None)
        try:
            return bool(is_initialized()) if is_initialized is not None else True
        except Exception:
            return False

    def device_name(self) -> str:
        try:
            return f"{self.name}:{self.index} {self.module.get_device_name(self.index)}"
        except Exception:
            return f"{self.name}:{self.index}"

    def _stats(self) -> dict[str, Any]:
        if not hasattr(self.module, "memory_stats"):
            return {}
        try:
            stats = self.module.memory_stats(self._index)
        except Exception:
            return {}
        return stats if isinstance(stats, dict) else {}

    def reset_peaks(self) -> None:
        if not self.peaks_resettable or not self._ready():
            return
        try:
            self.module.reset_peak_memory_stats(self._index)
        except Exception:  # AttributeError/RuntimeError on a build without the backend compiled in
            self.peaks_resettable = False
            self._warn_once("reset", f"{self.name}: cannot reset peak memory stats; device peaks are lifetime peaks")

    def read(self) -> DeviceReading:
        stats = self._stats()
        used = total = None
        if hasattr(self.module, "mem_get_info") and self._ready():
            try:
                free, total_ = self.module.mem_get_info(self._index)
                total = int(total_)
                used = total - int(free)
            except Exception:
                pass

        def get(key: str) -> int | None:
            value = stats.get(key)
            return None if value is None else int(value)

        return DeviceReading(
            allocated=get("allocated_bytes.all.current"),
            reserved=get("reserved_bytes.all.current"),
            peak_allocated=get("allocated_bytes.all.peak"),
            peak_reserved=get("reserved_bytes.all.peak"),
            used=used,
            total=total,
            alloc_retries=get("num_alloc_retries"),
            ooms=get("num_ooms"),
        )


def select_backend(device: str = "auto", device_module: Any = None) -> DeviceBackend | None:
    """Pick the backend once. ``device``: ``auto``, ``cuda``, ``npu``, ``xpu``, or ``cpu``/``none``.

    ``device_module`` replaces the torch module of the named backend (``cuda`` when ``device`` is
    ``auto``): the way tests pass in a fake ``torch.cuda``.
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
        try:
            available = bool(module.is_available())
        except Exception:
            available = False
        if available or device != "auto":
            # An explicitly named backend is used even when unavailable: its figures then read None.
            return DeviceBackend(name, module)
    return None
