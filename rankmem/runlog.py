"""The JSONL run log: the source of truth for ``rankmem report``, ``plot`` and ``leaks``.

Line 1 is the header (``kind: "header"``, ``schema``, versions, world size, per-rank host and device,
config); then one ``kind: "step"`` line per logged step with the aggregated metrics and the per-rank
vectors. Non-finite numbers are written as ``null``. Each line is written whole and flushed, so a
crash loses at most the line being written, and readers skip a truncated last line.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from typing import IO, Any

from rankmem._records import RunHeader, StepRecord

SCHEMA = 1
RUN_LOG_NAME = "rankmem.jsonl"


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def header_to_json(header: RunHeader) -> dict[str, Any]:
    from rankmem import __version__

    try:
        import torch

        torch_version: str | None = str(torch.__version__)
    except ImportError:
        torch_version = None
    return {
        "kind": "header",
        "schema": SCHEMA,
        "rankmem": __version__,
        "torch": torch_version,
        "world_size": header.world_size,
        "started": header.started,
        "ranks": [asdict(r) for r in header.ranks],
        "config": header.config,
    }


def record_to_json(record: StepRecord) -> dict[str, Any]:
    return {
        "kind": "step",
        "step": record.step,
        "time": record.time,
        "metrics": {k: _finite(v) for k, v in record.metrics.items()},
        "ranks": {k: [_finite(v) for v in vs] for k, vs in record.ranks.items()},
    }


class RunLogWriter:
    """Appends whole, flushed lines to ``path``; the header is written once, by :meth:`open`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def open(self, header: RunHeader) -> None:
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        self._file = open(self.path, "w", encoding="utf-8")
        self._write_line(header_to_json(header))

    def _write_line(self, obj: dict[str, Any]) -> None:
        assert self._file is not None, "RunLogWriter.open() must come first"
        # One write() of the whole line, then flush: a reader never sees half a line but for a crash.
        self._file.write(json.dumps(obj, allow_nan=False, separators=(",", ":")) + "\n")
        self._file.flush()

    def write(self, record: StepRecord) -> None:
        self._write_line(record_to_json(record))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
