"""rankmem: correct, cheap, per-rank memory telemetry for distributed PyTorch training.

Public API: :class:`Monitor` (built on every rank), :class:`MonitorConfig`, :func:`sample` for a
one-off local reading, the records it returns, and the verl drop-in
:func:`allgather_dict_into_dict`. Importing rankmem does not import torch.
"""

from __future__ import annotations

from rankmem.core.records import DeviceReading, HostReading
from rankmem.core.version import __version__
from rankmem.errors import MissingExtraError, RankmemError
from rankmem.exchange.dict_gather import allgather_dict_into_dict
from rankmem.monitor import Monitor, MonitorConfig
from rankmem.probe.sample import MemorySample, sample

__all__ = [
    "DeviceReading",
    "HostReading",
    "MemorySample",
    "MissingExtraError",
    "Monitor",
    "MonitorConfig",
    "RankmemError",
    "__version__",
    "allgather_dict_into_dict",
    "sample",
]
