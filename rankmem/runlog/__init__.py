"""The run log as written, on the logging rank: its layout, the JSONL writer, the columnar side file.

Line 1 is the header; then one line per logged step with the aggregated metrics, the per-rank values
in the columnar side file. Non-finite numbers are written as ``null``. Each line is written whole and
flushed, so a crash loses at most the line being written. Reading is offline code:
:func:`rankmem.offline.read_run`.

- :mod:`~rankmem.runlog.layout`: the line layout, defined once.
- :mod:`~rankmem.runlog.writer`: :class:`RunLogWriter`.
- :mod:`~rankmem.runlog.columnar`: the Arrow side file's writer.
"""

from __future__ import annotations

from rankmem.core.scalars import json_safe
from rankmem.runlog.header import header_to_json
from rankmem.runlog.layout import RUN_LOG_NAME, SCHEMA, SUPPORTED_SCHEMAS
from rankmem.runlog.writer import RunLogWriter

__all__ = ["RUN_LOG_NAME", "SCHEMA", "SUPPORTED_SCHEMAS", "RunLogWriter", "header_to_json", "json_safe"]
