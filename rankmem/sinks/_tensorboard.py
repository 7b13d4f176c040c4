"""The ``tensorboard`` sink: the aggregated keys as scalars under ``<out_dir>/tb``.

Uses TensorBoard's own event writer, so it needs the ``tensorboard`` package but not torch.
"""

from __future__ import annotations

import math
import os
import re
import time
from typing import Any

from rankmem.core.records import RunHeader, StepRecord
from rankmem.core.rundir import RunDir
from rankmem.errors import RankmemError

# TensorBoard shows any tag, but TensorFlow's summary ops reject these characters; keep tags portable.
_TAG_BAD = re.compile(r"[^A-Za-z0-9_./\-]")


def tb_tag(key: str) -> str:
    return _TAG_BAD.sub("_", key)


class TensorBoardSink:
    """Writes one scalar per aggregated key and step; ``logdir`` defaults to ``<out_dir>/tb``."""

    def __init__(self, out_dir: str | None = None, logdir: str | None = None, flush_secs: float = 10.0) -> None:
        if logdir is None:
            if out_dir is None:
                raise RankmemError("the tensorboard sink needs a directory: pass out_dir='runs/NAME' to the Monitor")
            logdir = RunDir(out_dir).tb
        self.logdir = logdir
        self._flush_secs = flush_secs
        self._writer: Any = None

    def open(self, header: RunHeader) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        os.makedirs(self.logdir, exist_ok=True)
        self._writer = EventFileWriter(self.logdir, flush_secs=self._flush_secs, filename_suffix=".rankmem")

    def write(self, record: StepRecord) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [
            Summary.Value(tag=tb_tag(k), simple_value=v) for k, v in record.metrics.items() if math.isfinite(v)
        ]
        event = Event(wall_time=record.time or time.time(), step=record.step, summary=Summary(value=values))
        self._writer.add_event(event)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
