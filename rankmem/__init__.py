"""rankmem: correct, cheap, per-rank memory telemetry for distributed PyTorch training.

Public API: :class:`Monitor` (built on every rank), :class:`MonitorConfig`, :func:`sample` for a
one-off local reading, the records it returns, and the verl drop-in
:func:`allgather_dict_into_dict`. Importing rankmem does not import torch.
"""

from __future__ import annotations

from rankmem._collective import allgather_dict_into_dict
from rankmem._monitor import Monitor, MonitorConfig
from rankmem._records import DeviceReading, HostReading
from rankmem._sample import MemorySample, sample
from rankmem.errors import MissingExtraError, RankmemError

__version__ = "0.1.0"

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
