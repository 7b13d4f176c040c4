"""``rankmem.sample()``: one local reading, no windows and no collective."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from rankmem._device import select_backend
from rankmem._host import make_host_probe
from rankmem._records import MemorySample


def sample(device: str = "auto", device_module: Any = None, children: bool = True) -> MemorySample:
    """Read this process, its children, its node and its device now.

    ``peak_rss`` and the device peaks are whatever the kernel and allocator hold (usually lifetime
    peaks, unless something reset them): windowed peaks need a :class:`rankmem.Monitor`.
    Opens and closes its descriptors on every call: for a per-step reading use a Monitor.
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
