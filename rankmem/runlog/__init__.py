"""The JSONL run log: the source of truth for ``rankmem report``, ``plot`` and ``leaks``.

Line 1 is the header; then one line per logged step with the aggregated metrics and the per-rank
vectors. Non-finite numbers are written as ``null``. Each line is written whole and flushed, so a
crash loses at most the line being written, and readers skip a truncated last line.

- :mod:`~rankmem.runlog._layout`: the line layout, defined once.
- :mod:`~rankmem.runlog._writer`: :class:`RunLogWriter` (online, on the logging rank).
- :mod:`~rankmem.runlog._reader`: :func:`read_run` -> :class:`Run` (offline).

The reader's names load on first use: the ``jsonl`` sink imports the writer, and importing it through
this package must not pull the offline reader into every training process.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rankmem._scalars import json_safe
from rankmem.runlog._layout import RUN_LOG_NAME, SCHEMA, SUPPORTED_SCHEMAS
from rankmem.runlog._writer import RunLogWriter, header_to_json

if TYPE_CHECKING:
    from rankmem.runlog._reader import Run, read_run, resolve_run_path

__all__ = [
    "RUN_LOG_NAME",
    "SCHEMA",
    "SUPPORTED_SCHEMAS",
    "Run",
    "RunLogWriter",
    "header_to_json",
    "json_safe",
    "read_run",
    "resolve_run_path",
]

_READER_NAMES = ("Run", "read_run", "resolve_run_path")


def __getattr__(name: str) -> Any:
    if name in _READER_NAMES:
        return getattr(importlib.import_module("rankmem.runlog._reader"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
