"""The device split by owner as a Monitor builds it: NVML's process list joined with the heartbeats.

The split itself is the probe's (:mod:`rankmem.probe.nvmlwatch`); what it needs from this layer is who
this node's other ranks are, which their heartbeats say (:func:`rankmem.forensics.heartbeat.node_siblings`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rankmem.exchange.dist import global_rank
from rankmem.forensics.heartbeat import heartbeat_dir, node_siblings
from rankmem.probe.device import DeviceBackend
from rankmem.probe.nvmlwatch import DeviceAttribution
from rankmem.windows import Where

OFF = "off (needs CUDA and nvml_refresh_s; a fake torch.cuda needs a fake NVML)"
"""What ``rankmem doctor`` shows where no attribution was built."""


def device_attribution(device: DeviceBackend | None, refresh_s: float | None, out_dir: str | None,
                       nvml_module: Any, where_now: Callable[[], Where]) -> DeviceAttribution | None:
    """NVML's split of device used, on CUDA: the real ``torch.cuda`` with pynvml, or a fake pair; None
    elsewhere, or with ``refresh_s`` None (attribution off)."""
    real = device is not None and getattr(device.module, "__name__", None) == "torch.cuda"
    if device is None or device.name != "cuda" or refresh_s is None:
        return None
    if nvml_module is None and not real:
        return None  # a fake torch.cuda without a fake NVML: the real driver knows nothing of it
    beats, rank = heartbeat_dir(out_dir), global_rank()

    def where() -> tuple[int | None, str | None]:
        try:  # read from the attribution thread while the training thread opens and closes phases
            w = where_now()
        except IndexError:  # the phase stack emptied between its test and its read
            return None, None
        return w.step, w.phase

    return DeviceAttribution(device, refresh_s, nvml_module=nvml_module, where=where,
                             siblings=lambda translated: node_siblings(beats, rank, translated))
