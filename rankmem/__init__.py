"""rankmem: correct, cheap, per-rank memory telemetry for distributed PyTorch training.

Public API: :class:`Monitor` (built on every rank), :class:`MonitorConfig`, :func:`sample` for a
one-off local reading, the records it returns, and the verl drop-in
:func:`allgather_dict_into_dict`. Importing rankmem does not import torch, and each name loads its
modules when first used: the command line and the offline layer (``rankmem.cli``, the report) never
load the Monitor's, nor the Monitor theirs.
"""

from __future__ import annotations

import importlib

from rankmem.core.version import __version__

TYPE_CHECKING = False  # typing itself costs a verl worker's setup hook more than this whole package
if TYPE_CHECKING:
    from typing import Any

    from rankmem.core.records import DeviceReading, HostReading
    from rankmem.errors import MissingExtraError, RankmemError
    from rankmem.exchange.dict_gather import allgather_dict_into_dict
    from rankmem.monitor import Monitor, MonitorConfig
    from rankmem.probe.sample import MemorySample, sample
del TYPE_CHECKING

# Loaded on first use: rankmem.integrations.verl.setup, in every Ray worker of a verl job, imports this.
_HOME = {name: f"rankmem.{module}" for module, names in (
    ("core.records", "DeviceReading HostReading"), ("errors", "MissingExtraError RankmemError"), ("monitor",
     "Monitor MonitorConfig"), ("exchange.dict_gather", "allgather_dict_into_dict"), ("probe.sample",
     "MemorySample sample")) for name in names.split()}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'rankmem' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value  # the next look-up is a plain attribute
    return value


__all__ = ["DeviceReading", "HostReading", "MemorySample", "MissingExtraError", "Monitor", "MonitorConfig",
           "RankmemError", "__version__", "allgather_dict_into_dict", "sample"]
