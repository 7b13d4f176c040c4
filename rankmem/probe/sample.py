"""``rankmem.sample()``: one local reading, no windows and no collective."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rankmem.core.catalogue import MEMORY_PREFIX, key_of, window_metrics
from rankmem.core.records import DeviceReading, HostReading, WindowBytes
from rankmem.probe.device import select_backend
from rankmem.probe.host import make_host_probe

GIB_SUFFIX = "_gib"


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
        out: dict[str, float] = {}
        window_metrics(WindowBytes.of(self.host, self.device), out)
        return out

    def __repr__(self) -> str:
        # GiB at the edge, as everywhere a person reads figures; the fields keep their bytes.
        parts = [f"device={self.device_name!r}"]
        if self.device is not None and self.device.before_init:
            parts.append("device figures=None (not initialised yet: reading would create a context)")
        for key, value in self.to_metrics().items():
            name = key.removeprefix(MEMORY_PREFIX)
            if name.endswith(GIB_SUFFIX):
                parts.append(f"{name.removesuffix(GIB_SUFFIX)}={value:.3f} GiB")
            else:
                parts.append(f"{name}={value:g}")
            if key == key_of("peak_rss") and self.host.peak_rss_is_lifetime:
                parts[-1] += " (lifetime)"
        return f"MemorySample({', '.join(parts)})"

    __str__ = __repr__


def sample(device: str = "auto", device_module: Any = None, children: bool = True) -> MemorySample:
    """Read this process, its children, its node and its device now.

    ``peak_rss`` and the device peaks are whatever the kernel and allocator hold (usually lifetime peaks):
    windowed peaks, and per-step readings, need a :class:`rankmem.Monitor`. Before the program's first CUDA
    call the device figures are ``None`` (``device.before_init``): reading them would create a context.
    """
    host = make_host_probe(children=children)
    try:
        # Nothing resets VmHWM here: the peak is the process's lifetime peak, and says so.
        reading = replace(host.read(), peak_rss_is_lifetime=True)
    finally:
        host.close()
    backend = select_backend(device, device_module)
    return MemorySample(
        host=reading,
        device=backend.read() if backend is not None else None,
        device_name=backend.name if backend is not None else "none",
    )
