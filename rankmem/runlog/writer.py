"""The run-log writer, on the logging rank: the header once, then one whole line per step.

Lines follow :mod:`rankmem.runlog.layout`: the aggregates on the line, the per-rank values in the
columnar side file (:mod:`rankmem.runlog.columnar`), or on the line with ``detail="inline"`` (also what
it falls back to, with one warning, where pyarrow is not installed). Each line is one ``write(2)`` to a file opened for
appending, with no buffer in between: a crash loses at most the line being written. A write that fails
part-way (a full disk takes what fits, then says ENOSPC) is cut back to the last whole line, so the
file never holds half a line followed by later whole ones; the caller (:class:`rankmem.sinks.SafeSink`)
retries later and reports the steps lost. The header carries the run's identity (``run_id``), which
the side file and the run's events and heartbeats carry too. Online code: it imports nothing of the reader.
"""

from __future__ import annotations

import json
import os
from typing import Any

from rankmem.core.records import RunHeader, StepRecord
from rankmem.core.rundir import RunDir, open_regular, unlinked
from rankmem.core.scalars import json_safe
from rankmem.core.warnings import WarnOnce, warn
from rankmem.errors import RankmemError
from rankmem.runlog.append import append_whole
from rankmem.runlog.checksum import header_crc
from rankmem.runlog.columnar import DetailWriter, pyarrow_available
from rankmem.runlog.detail_pipe import DetailPipe
from rankmem.runlog.header import header_to_json
from rankmem.runlog.layout import (
    INLINE,
    SEPARATORS,
    STEP_MAX,
    STEP_MIN,
    step_object,
)

_RANK_SUFFIX = "_rank"


def _integer_ranks(metrics: dict[str, float]) -> dict[str, Any]:
    """``K/max_rank`` and ``K/min_rank`` as JSON integers (``1``, not ``1.0``): the aggregate carries
    them as floats because it is one float64 block, but a rank is a rank. -1 (no rank had ``K``) stays
    -1; readers take old logs' floats alike."""
    return {k: int(v) if k.endswith(_RANK_SUFFIX) and v == v else v for k, v in metrics.items()}


class RunLogWriter:
    """Appends whole lines to ``path``; the header is written once, by :meth:`open`.

    Both methods raise ``OSError`` when the disk refuses a line (nothing of it stays in the file) and
    may be called again: :meth:`open` after a failure starts over, :meth:`write` goes on appending. A
    log whose file was deleted under it (the run directory removed mid-run) raises
    :class:`~rankmem.errors.RankmemError`: what it would write next is lost, which the caller says once.
    Its own job only: the run directory's lock and the rotation of an earlier run are the caller's
    (:class:`rankmem.sinks._jsonl.JsonlSink` asks :class:`~rankmem.core.rundir.RunDir`).
    """

    COLUMNAR = "columnar"

    def __init__(self, path: str, detail: str = COLUMNAR, detail_process: bool = False) -> None:
        """``detail_process``: write the side file from a writer process (:mod:`rankmem.runlog.detail_pipe`)
        instead of this one, which then never imports pyarrow (the Monitor's run log does so)."""
        if detail not in (self.COLUMNAR, INLINE):
            raise ValueError(f"detail must be {self.COLUMNAR!r} or {INLINE!r}, got {detail!r}")
        self.path = path
        self.run_dir = RunDir.of_log(path)
        self.detail_path = self.run_dir.detail
        self._columnar = detail == self.COLUMNAR
        self._detail: DetailWriter | DetailPipe | None = None
        self._detail_process = detail_process
        self._collects = 0
        self._fd: int | None = None
        self._size = 0  # bytes of whole lines in the file: where a failed write is cut back to
        self._warn_once = WarnOnce()

    def open(self, header: RunHeader) -> None:
        self._close_fd()
        if self._columnar and not pyarrow_available():
            self._columnar = False
            warn("rankmem: pyarrow is not installed, so the run log keeps the per-rank values on its lines "
                 "(slower to report on at scale); pip install pyarrow to write them to the columnar side file")
        os.makedirs(self.run_dir.root, exist_ok=True)
        self._fd = open_regular(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
        self._size = 0
        self._collects = 0
        # default=str: the caller's config may hold paths; they become strings, not a lost header.
        raw = header_to_json(header, os.path.basename(self.detail_path) if self._columnar else INLINE)
        line = json.dumps(json_safe(raw), allow_nan=False, separators=SEPARATORS, default=str)
        try:
            self._write_line(line)
            if self._columnar:
                kind = DetailPipe if self._detail_process else DetailWriter
                self._detail = kind(self.detail_path, header.world_size, header.run_id,
                                    header_crc((line + "\n").encode("utf-8")))
                self._detail.open()
        except OSError:
            self._close_fd()  # the next open() starts over on the empty file
            raise

    def write(self, record: StepRecord) -> None:
        if not STEP_MIN <= record.step <= STEP_MAX:
            # The reader holds steps as int64; a line it must count as corrupt is better not written.
            self._warn_once(f"step-range:{record.step}", f"step {record.step} is outside the run log's 64-bit "
                                                         f"step range; that record is not written to {self.path}")
            return
        # Hot path: encode as is, and only when the text holds a non-finite token (NaN, Infinity,
        # which JSON lacks) rebuild the record with nulls. Checking every value in Python first cost
        # more than the encoding itself.
        ranks = None if self._columnar else record.columns()
        raw = step_object(record.step, record.time, _integer_ranks(record.metrics), ranks)
        line = json.dumps(raw, separators=SEPARATORS)
        if "NaN" in line or "Infinity" in line:
            line = json.dumps(json_safe(raw), allow_nan=False, separators=SEPARATORS)
        self._write_line(line)
        if self._detail is not None:
            self._detail.add(self._collects, record, self._size)
        self._collects += 1

    def flush(self) -> None:
        """Write the per-rank values still waiting for their batch (the lines are never buffered)."""
        if self._detail is not None:
            self._detail.flush()

    def _write_line(self, line: str) -> None:
        assert self._fd is not None, "RunLogWriter.open() must come first"
        # One fstat (~1 us, on the sink thread): a deleted file takes writes without a word.
        if unlinked(self._fd):
            self._close_fd()
            raise RankmemError(f"{self.path} was deleted while the run wrote it (its directory removed?); "
                               "the run log stops here and later steps are not logged")
        self._size += append_whole(self._fd, (line + "\n").encode("utf-8"), self._size, self.path)

    def _close_fd(self) -> None:
        if self._detail is not None:
            detail, self._detail = self._detail, None
            detail.close()
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def close(self) -> None:
        self._close_fd()
