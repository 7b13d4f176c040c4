"""The run log as written, on the logging rank: its layout (:mod:`~rankmem.runlog.layout`, which draws
the format) and :class:`~rankmem.runlog.writer.RunLogWriter`. Reading: :func:`rankmem.offline.read_run`."""

from __future__ import annotations

from rankmem.runlog.layout import RUN_LOG_NAME, SCHEMA
from rankmem.runlog.writer import RunLogWriter

__all__ = ["RUN_LOG_NAME", "SCHEMA", "RunLogWriter"]
