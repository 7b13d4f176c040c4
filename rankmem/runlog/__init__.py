"""The run log as written, on the logging rank: its layout (:mod:`~rankmem.runlog.layout`, which draws
the format) and :class:`~rankmem.runlog.writer.RunLogWriter`. Reading is offline code:
:func:`rankmem.offline.read_run`.
"""

from __future__ import annotations

from rankmem.core.scalars import json_safe
from rankmem.runlog.header import header_to_json
from rankmem.runlog.layout import RUN_LOG_NAME, SCHEMA, SUPPORTED_SCHEMAS
from rankmem.runlog.writer import RunLogWriter

__all__ = ["RUN_LOG_NAME", "SCHEMA", "SUPPORTED_SCHEMAS", "RunLogWriter", "header_to_json", "json_safe"]
