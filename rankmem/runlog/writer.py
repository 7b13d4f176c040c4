"""The run-log writer, on the logging rank's run-log thread: the header once, then per collect one
side-file record (its per-rank values) and one line (its aggregates), in :mod:`rankmem.runlog.layout`.
Each is one unbuffered ``write(2)`` in append mode: a crash loses at most the collect being written, and
a write the disk refuses part-way (ENOSPC) is cut back to the last whole record. :meth:`RunLogWriter.write`
never raises for the disk: a collect it cannot write joins a pending gap (:meth:`RunLogWriter.lost` adds
those its queue dropped), written as a GAP record and a gap line once the disk takes writes again, and
warned about at :meth:`close` if it never does. Online code: it imports nothing of the reader."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import zlib
from typing import Any

from rankmem.core.records import RunHeader, StepRecord
from rankmem.core.rundir import RunDir, open_regular, unlinked
from rankmem.core.scalars import json_safe
from rankmem.core.warnings import WarnOnce, warn
from rankmem.errors import RankmemError
from rankmem.runlog import layout as L
from rankmem.runlog.header import header_to_json

_NO_KEYS = 2**64 - 1


def append_whole(fd: int, data: bytes, size: int, path: str) -> int:
    """Write ``data`` to ``fd`` (O_APPEND, ``size`` bytes of whole records so far); return its length.
    A regular file takes it in one ``write(2)`` unless the disk fills: then what went in is cut off
    again and the OSError raised, so that the file never holds half a record followed by whole ones."""
    view, done = memoryview(data), 0
    try:
        while done < len(view):
            n = os.write(fd, view[done:])
            if n == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
            done += n
    except OSError:
        if done:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
        raise
    return done


def record(kind: int, payload: bytes) -> bytes:
    """One side-file record: kind, length, payload, and the checksum of all of it."""
    body = L.RECORD_HEAD.pack(kind, len(payload) // 8) + payload
    import numpy as np  # on the sink thread, as below
    return body + int(L.checksums(np.frombuffer(body, dtype="<u8"))).to_bytes(8, "little")


def _line(obj: dict[str, Any]) -> bytes:
    line = json.dumps(obj, separators=L.SEPARATORS)
    if "NaN" in line or "Infinity" in line:  # JSON has neither: rebuilt with nulls only when needed
        line = json.dumps(json_safe(obj), allow_nan=False, separators=L.SEPARATORS)
    return (line + "\n").encode()


class RunLogWriter:
    """Appends whole records to ``path`` and its side file; the headers are written by :meth:`open`.
    :meth:`open` raises ``OSError`` when the disk refuses the header (call it again to start over); a log
    whose file was deleted under it raises :class:`~rankmem.errors.RankmemError`. The lock and the rotation
    are the caller's (:class:`rankmem.sinks._jsonl.JsonlSink`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.run_dir = RunDir.of_log(path)
        self.detail_path = self.run_dir.detail
        self._fd: int | None = None
        self._side: int | None = None
        self._size = self._side_size = 0  # bytes of whole records: where a failed write is cut back to
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
        line = (json.dumps(json_safe(raw), allow_nan=False, separators=L.SEPARATORS, default=str) + "\n").encode()
        try:
            self._size += append_whole(self._fd, line, 0, self.path)
            self._side = open_regular(self.detail_path, flags)
            run_id = (header.run_id or "").encode("ascii").ljust(16, b"\0")[:16]
            head = L.FILE_HEADER.pack(L.MAGIC, L.VERSION, header.world_size, run_id, zlib.crc32(line))
            self._side_size += append_whole(self._side, head, 0, self.detail_path)
        except OSError:
            self._close_fds()  # the next open() starts over on empty files
            raise

    def write(self, rec: StepRecord) -> None:
        if not L.STEP_MIN <= rec.step <= L.STEP_MAX:
            # The reader holds steps as int64; a line it must count as corrupt is better not written.
            self._warn_once(f"step-range:{rec.step}", f"step {rec.step} is outside the run log's 64-bit "
                                                      f"step range; that record is not written to {self.path}")
            return
        assert self._fd is not None and self._side is not None, "RunLogWriter.open() must come first"
        if unlinked(self._fd):  # one fstat (~1 us): a deleted file takes writes without a word
            self._close_fds()
            raise RankmemError(f"{self.path} was deleted while the run wrote it (its directory removed?); "
                               "the run log stops here and later steps are not logged")
        # K/max_rank and K/min_rank as JSON integers: the aggregate is one float64 block, a rank a rank.
        metrics = {k: int(v) if k.endswith("_rank") and v == v else v for k, v in rec.metrics.items()}
        side, gap_line = self._gap_records()
        line = _line({"kind": L.STEP_KIND, "step": rec.step, "time": rec.time, "metrics": metrics})
        keys, matrix, key_set, k, block = rec.keys, rec.matrix, _NO_KEYS, 0, b""
        if matrix is None and rec.ranks:
            import numpy as np  # on the sink thread: `import rankmem` and Monitor() load no numpy
            keys = tuple(rec.ranks)
            matrix = np.array([[np.nan if v is None else v for v in rec.ranks[k]] for k in keys], dtype=float).T
        if matrix is not None:
            key_set = self._key_sets.get(tuple(keys), len(self._key_sets))
            if key_set == len(self._key_sets):
                names = json.dumps(list(keys)).encode()
                side += record(L.KEYS, L.KEYS_HEAD.pack(key_set, len(names)) + L.padded(names))
            block, k = matrix.astype("<f8", order="C", copy=False).tobytes(), len(keys)
        offset = self._size + len(gap_line)  # where the collect's line starts
        side += record(L.COLLECT, L.COLLECT_HEAD.pack(rec.step, rec.time, offset, key_set, k) + block)
        try:
            self._append(side, gap_line + line)
        except OSError as exc:
            self.lost(rec.step, rec.step, 1, f"the disk refused it ({exc.strerror or exc})")
            return
        if matrix is not None:
            self._key_sets.setdefault(tuple(keys), key_set)

    def _append(self, side: bytes, lines: bytes) -> None:
        """Records to the side file, then their lines to the log: the records go back if the lines fail."""
        assert self._fd is not None and self._side is not None
        written = append_whole(self._side, side, self._side_size, self.detail_path)
        try:
            self._size += append_whole(self._fd, lines, self._size, self.path)
        except OSError:
            os.ftruncate(self._side, self._side_size)
            raise
        self._side_size += written
        self._gap = None

    def _gap_records(self) -> tuple[bytes, bytes]:
        """The pending gap as a GAP record and a gap line (``jq 'select(.kind == "gap")'``), or nothing."""
        if self._gap is None:
            return b"", b""
        first, last, count, why = self._gap
        text = why.encode()
        line = _line({"kind": L.GAP_KIND, "first": first, "last": last, "count": count, "why": why})
        return record(L.GAP, L.GAP_HEAD.pack(first, last, count, len(text)) + L.padded(text)), line

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
            with contextlib.suppress(OSError):  # the gap stays pending
                self._append(*self._gap_records())

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
