"""The ``jsonl`` / ``file`` sink: the run log (see :mod:`rankmem.runlog`)."""

from __future__ import annotations

import os

from rankmem.errors import RankmemError
from rankmem.runlog.layout import RUN_LOG_NAME
from rankmem.runlog.writer import RunLogWriter


class JsonlSink(RunLogWriter):
    """Writes ``<out_dir>/rankmem.jsonl`` (or ``path``)."""

    def __init__(self, out_dir: str | None = None, path: str | None = None) -> None:
        if path is None:
            if out_dir is None:
                raise RankmemError("the jsonl sink needs a directory: pass out_dir='runs/NAME' to the Monitor")
            path = os.path.join(out_dir, RUN_LOG_NAME)
        # The side file from a writer process: pyarrow (~45 MiB) stays out of the logging rank (issue 22).
        super().__init__(path, detail_process=True)
