"""The ``jsonl`` / ``file`` sink: the run log (see :mod:`rankmem.runlog`), in its run directory.

Opening it claims the directory (:class:`rankmem.core.rundir.RunDir`): its lock, unless the launcher
that started this process holds it, then every file of an earlier run moved aside with one number
(the ranks' files of this run, which carry its run id, stay), one warning line per destination.
"""

from __future__ import annotations

import os

from rankmem.core.lock import RunDirLock
from rankmem.core.records import RunHeader
from rankmem.core.rundir import RUN_LOG_NAME, rotated_lines
from rankmem.core.warnings import warn
from rankmem.errors import RankmemError
from rankmem.forensics.heartbeat import heartbeat_run_id
from rankmem.runlog.writer import RunLogWriter


class JsonlSink(RunLogWriter):
    """Writes ``<out_dir>/rankmem.jsonl`` (or ``path``)."""

    def __init__(self, out_dir: str | None = None, path: str | None = None) -> None:
        if path is None:
            if out_dir is None:
                raise RankmemError("the jsonl sink needs a directory: pass out_dir='runs/NAME' to the Monitor")
            path = os.path.join(out_dir, RUN_LOG_NAME)
        super().__init__(path)
        self._lock = RunDirLock(self.run_dir.root)

    def open(self, header: RunHeader) -> None:
        if not self.run_dir.lock_held_by_launcher():
            self._lock.acquire()  # before the rotation: a second job must not move this one's log aside
        for line in rotated_lines(self.run_dir.rotate(header.run_id, heartbeat_run_id)):
            warn(f"rankmem: {line}")
        super().open(header)

    def close(self) -> None:
        super().close()
        self._lock.release()
