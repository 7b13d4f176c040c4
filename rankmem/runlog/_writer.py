"""The run-log writer, on the logging rank: the header once, then one whole, flushed line per step.

Lines follow :mod:`rankmem.runlog._layout`. Each is written whole and flushed, so a crash loses at
most the line being written; a restart into the same directory first moves the earlier log aside.
Online code: it imports nothing of the reader.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import IO, Any

from rankmem._records import RunHeader, StepRecord
from rankmem._scalars import json_safe
from rankmem.errors import warn
from rankmem.runlog._layout import HEADER_KIND, SCHEMA, SEPARATORS, step_object


def _rotate(path: str) -> str | None:
    """Move an existing non-empty log aside (``rankmem.jsonl.1``, ``.2``, ...) so that a restarted job
    with the same ``out_dir`` never truncates the records of the run before it."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return None
    n = 1
    while os.path.exists(f"{path}.{n}"):
        n += 1
    os.replace(path, f"{path}.{n}")
    return f"{path}.{n}"


def header_to_json(header: RunHeader) -> dict[str, Any]:
    from rankmem import __version__

    try:
        import torch

        torch_version: str | None = str(torch.__version__)
    except ImportError:
        torch_version = None
    return {
        "kind": HEADER_KIND,
        "schema": SCHEMA,
        "rankmem": __version__,
        "torch": torch_version,
        "world_size": header.world_size,
        "started": header.started,
        "ranks": [asdict(r) for r in header.ranks],
        "config": header.config,
    }


_RANK_SUFFIX = "_rank"


def _integer_ranks(metrics: dict[str, float]) -> dict[str, Any]:
    """``K/max_rank`` and ``K/min_rank`` as JSON integers (``1``, not ``1.0``): the aggregate carries
    them as floats because it is one float64 block, but a rank is a rank. -1 (no rank had ``K``) stays
    -1; readers take old logs' floats alike."""
    return {k: int(v) if k.endswith(_RANK_SUFFIX) and v == v else v for k, v in metrics.items()}


class RunLogWriter:
    """Appends whole, flushed lines to ``path``; the header is written once, by :meth:`open`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def open(self, header: RunHeader) -> None:
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        rotated = _rotate(self.path)
        self._file = open(self.path, "w", encoding="utf-8")
        # default=str: the caller's config may hold paths; they become strings, not a lost header.
        self._write_line(json.dumps(json_safe(header_to_json(header)), allow_nan=False, separators=SEPARATORS,
                                    default=str))
        if rotated:
            warn(f"rankmem: {self.path} existed (a restarted job?); kept it as {rotated}")

    def write(self, record: StepRecord) -> None:
        # Hot path: encode as is, and only when the text holds a non-finite token (NaN, Infinity,
        # which JSON lacks) rebuild the record with nulls. Checking every value in Python first cost
        # more than the encoding itself.
        raw = step_object(record.step, record.time, _integer_ranks(record.metrics), record.ranks)
        line = json.dumps(raw, separators=SEPARATORS)
        if "NaN" in line or "Infinity" in line:
            line = json.dumps(json_safe(raw), allow_nan=False, separators=SEPARATORS)
        self._write_line(line)

    def _write_line(self, line: str) -> None:
        assert self._file is not None, "RunLogWriter.open() must come first"
        # One write() of the whole line, then flush: a reader never sees half a line but for a crash.
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
