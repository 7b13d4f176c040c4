"""The run-log writer, on the logging rank's run-log thread: the header once, then per collect one
side-file record (its per-rank values) and one line (its aggregates), in :mod:`rankmem.runlog.layout`.

Each record and each line is one ``write(2)`` to a file opened for appending, with no buffer in between:
a crash loses at most the collect being written. A write that fails part-way (a full disk takes what
fits, then says ENOSPC) is cut back to the last whole record. :meth:`RunLogWriter.write` never raises
for the disk: a collect it cannot write joins a pending gap (:meth:`RunLogWriter.lost` adds those its
queue dropped), written as a GAP record, steps and reason, as soon as the disk takes writes again, and
warned about at :meth:`close` if it never does. Online code: it imports nothing of the reader.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Sequence
from typing import Any

from rankmem.core.records import RunHeader, StepRecord
from rankmem.core.rundir import RunDir, open_regular, unlinked
from rankmem.core.scalars import json_safe
from rankmem.core.warnings import WarnOnce, warn
from rankmem.errors import RankmemError
from rankmem.runlog.append import append_whole
from rankmem.runlog.header import header_to_json
from rankmem.runlog.layout import (
    COLLECT,
    COLLECT_HEAD,
    FILE_HEADER,
    GAP,
    GAP_HEAD,
    KEYS,
    KEYS_HEAD,
    MAGIC,
    RECORD_HEAD,
    SEPARATORS,
    STEP_KIND,
    STEP_MAX,
    STEP_MIN,
    VERSION,
    padded,
)

_RANK_SUFFIX = "_rank"
_NO_KEYS = 2**64 - 1


def _integer_ranks(metrics: dict[str, float]) -> dict[str, Any]:
    """``K/max_rank`` and ``K/min_rank`` as JSON integers (``1``, not ``1.0``): the aggregate carries
    them as floats because it is one float64 block, but a rank is a rank. -1 stays -1."""
    return {k: int(v) if k.endswith(_RANK_SUFFIX) and v == v else v for k, v in metrics.items()}


def record(kind: int, payload: bytes) -> bytes:
    """One side-file record: kind, length, payload, and the CRC-32 of all of it."""
    body = RECORD_HEAD.pack(kind, len(payload) // 8) + payload
    return body + zlib.crc32(body).to_bytes(8, "little")


def _matrix(rec: StepRecord) -> tuple[Sequence[str], Any]:
    """The record's keys and ranks x keys float64 matrix (built from its per-rank lists if need be)."""
    if rec.matrix is not None or not rec.ranks:
        return rec.keys, rec.matrix
    keys = tuple(rec.ranks)
    import numpy as np  # on the sink thread: `import rankmem` and Monitor() load no numpy

    columns = [[np.nan if v is None else v for v in rec.ranks[k]] for k in keys]
    return keys, np.array(columns, dtype=np.float64).T


class RunLogWriter:
    """Appends whole records to ``path`` and its side file; the headers are written by :meth:`open`.

    :meth:`open` raises ``OSError`` when the disk refuses the header (call it again to start over); a log
    whose file was deleted under it raises :class:`~rankmem.errors.RankmemError`. The lock and the rotation
    are the caller's (:class:`rankmem.sinks._jsonl.JsonlSink`).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.run_dir = RunDir.of_log(path)
        self.detail_path = self.run_dir.detail
        self._fd: int | None = None
        self._side: int | None = None
        self._size = 0  # bytes of whole lines in the log: where a failed write is cut back to
        self._side_size = 0
        self._key_sets: dict[tuple[str, ...], int] = {}
        self._gap: list[Any] | None = None  # [first, last, count, why] of collects waiting for a GAP record
        self._warn_once = WarnOnce()

    def open(self, header: RunHeader) -> None:
        self._close_fds()
        os.makedirs(self.run_dir.root, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
        self._fd = open_regular(self.path, flags)
        self._size = self._side_size = 0
        self._key_sets = {}
        # The config was made JSON at the Monitor's construction; default=str covers a caller's header.
        raw = header_to_json(header, os.path.basename(self.detail_path))
        line = (json.dumps(json_safe(raw), allow_nan=False, separators=SEPARATORS, default=str) + "\n").encode()
        try:
            self._size += append_whole(self._fd, line, 0, self.path)
            self._side = open_regular(self.detail_path, flags)
            run_id = (header.run_id or "").encode("ascii").ljust(16, b"\0")[:16]
            head = FILE_HEADER.pack(MAGIC, VERSION, header.world_size, run_id, zlib.crc32(line))
            self._side_size += append_whole(self._side, head, 0, self.detail_path)
        except OSError:
            self._close_fds()  # the next open() starts over on empty files
            raise

    def write(self, rec: StepRecord) -> None:
        if not STEP_MIN <= rec.step <= STEP_MAX:
            # The reader holds steps as int64; a line it must count as corrupt is better not written.
            self._warn_once(f"step-range:{rec.step}", f"step {rec.step} is outside the run log's 64-bit "
                                                      f"step range; that record is not written to {self.path}")
            return
        assert self._fd is not None and self._side is not None, "RunLogWriter.open() must come first"
        if unlinked(self._fd):  # one fstat (~1 us): a deleted file takes writes without a word
            self._close_fds()
            raise RankmemError(f"{self.path} was deleted while the run wrote it (its directory removed?); "
                               "the run log stops here and later steps are not logged")
        raw = {"kind": STEP_KIND, "step": rec.step, "time": rec.time, "metrics": _integer_ranks(rec.metrics)}
        line = json.dumps(raw, separators=SEPARATORS)
        if "NaN" in line or "Infinity" in line:  # JSON has neither: rebuilt with nulls only when needed
            line = json.dumps(json_safe(raw), allow_nan=False, separators=SEPARATORS)
        keys, matrix = _matrix(rec)
        side, new_keys = self._gap_record(), None
        key_set = _NO_KEYS
        if matrix is not None:
            key_set = self._key_sets.get(tuple(keys), -1)
            if key_set < 0:
                key_set = new_keys = len(self._key_sets)
                names = json.dumps(list(keys)).encode()
                side += record(KEYS, KEYS_HEAD.pack(key_set, len(names)) + padded(names))
            import numpy as np  # loaded by the exchange already

            block = np.ascontiguousarray(matrix, dtype="<f8").tobytes()
        else:
            block = b""
        k = len(keys) if matrix is not None else 0
        side += record(COLLECT, COLLECT_HEAD.pack(rec.step, rec.time, self._size, key_set, k) + block)
        try:
            written = append_whole(self._side, side, self._side_size, self.detail_path)
            try:
                self._size += append_whole(self._fd, (line + "\n").encode(), self._size, self.path)
            except OSError:
                os.ftruncate(self._side, self._side_size)  # the record goes with its line
                raise
        except OSError as exc:
            self.lost(rec.step, rec.step, 1, f"the disk refused it ({exc.strerror or exc})")
            return
        self._side_size += written
        self._gap = None
        if new_keys is not None:
            self._key_sets[tuple(keys)] = new_keys

    def _gap_record(self) -> bytes:
        if self._gap is None:
            return b""
        first, last, count, why = self._gap
        text = why.encode()
        return record(GAP, GAP_HEAD.pack(first, last, count, len(text)) + padded(text))

    def lost(self, first: int, last: int, count: int, why: str) -> None:
        """Collects that are not in the log (the disk refused them, the queue dropped them): they join
        the pending gap, warned about once when it opens."""
        if self._gap is None:
            self._gap = [first, last, 0, why]
            warn(f"rankmem: the run log {self.path} could not take step {first} ({why}); the collects it "
                 "loses are named in a gap record when it can write again")
        gap = self._gap
        gap[:] = [min(gap[0], first), max(gap[1], last), gap[2] + count, why]

    def flush(self) -> None:
        """Write the pending gap record, if any (nothing else is buffered)."""
        if self._gap is not None and self._side is not None:
            try:
                self._side_size += append_whole(self._side, self._gap_record(), self._side_size, self.detail_path)
                self._gap = None
            except OSError:
                pass

    def _close_fds(self) -> None:
        for name in ("_fd", "_side"):
            fd = getattr(self, name)
            if fd is not None:
                setattr(self, name, None)
                os.close(fd)

    def close(self) -> None:
        self.flush()
        if self._gap is not None:
            first, last, count, why = self._gap
            warn(f"rankmem: {count} collect(s) not in the run log (steps {first}..{last}: {why}); the disk "
                 "took no gap record for them")
        self._close_fds()
