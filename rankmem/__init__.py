"""rankmem: correct, cheap, per-rank memory telemetry for distributed PyTorch training.

Public API: :class:`Monitor` (built on every rank), :class:`MonitorConfig`, :func:`sample` for a
one-off local reading, the records it returns, and the verl drop-in
:func:`allgather_dict_into_dict`. Importing rankmem does not import torch, and each name loads its
modules when first used: the command line and the offline layer (``rankmem.cli``, the report) never
load the Monitor's, nor the Monitor theirs.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

from rankmem.core.version import __version__
from rankmem.errors import MissingExtraError, RankmemError

if _typing.TYPE_CHECKING:
    from typing import Any

    from rankmem.core.records import DeviceReading, HostReading
    from rankmem.exchange.dict_gather import allgather_dict_into_dict
    from rankmem.monitor import Monitor, MonitorConfig
    from rankmem.probe.sample import MemorySample, sample

_WHERE = {"DeviceReading": "rankmem.core.records", "HostReading": "rankmem.core.records",
          "allgather_dict_into_dict": "rankmem.exchange.dict_gather", "Monitor": "rankmem.monitor",
          "MonitorConfig": "rankmem.monitor", "MemorySample": "rankmem.probe.sample",
          "sample": "rankmem.probe.sample"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'rankmem' has no attribute {name!r}")
    value = globals()[name] = getattr(_importlib.import_module(_WHERE[name]), name)
    return value


__all__ = ["DeviceReading", "HostReading", "MemorySample", "MissingExtraError", "Monitor", "MonitorConfig",
           "RankmemError", "__version__", "allgather_dict_into_dict", "sample"]
