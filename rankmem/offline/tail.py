"""The newest lines of a run log that is still being written, read from its end.

``rankmem watch`` redraws every second against a log that may be gigabytes long, so it never reads
the log whole: :func:`read_last_steps` seeks near the end, reads a block, and doubles the block
until it holds the lines it needs (a line at 1,024 ranks is ~1 MB). Whatever follows the last
newline is a line still being written and is left alone; the writer's one ``write()`` per line makes
every newline-terminated line whole. :class:`TailFollower` re-reads only when the file changed and
notices a rotation (a restarted job moved the log aside) by the file's identity.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from rankmem.core.files import open_binary
from rankmem.core.records import RunHeader
from rankmem.errors import RankmemError
from rankmem.runlog.header import header_from_json
from rankmem.runlog.layout import HEADER_KIND, STEP_KIND

_BAD_JSON = (ValueError, RecursionError)  # json.loads: not JSON; nested past the interpreter's depth

FIRST_BLOCK = 64 * 1024
MAX_BLOCK = 256 * 1024 * 1024
"""Reading back stops here: a log whose last N step lines do not fit in 256 MiB is not a run log."""


MAX_HEADER = 1 << 24
"""Bytes of a header line read at most (a header is a few KB per rank)."""


def read_header_line(path: str) -> bytes | None:
    """The header line of ``path`` as written, newline included; None when it is missing, not yet whole
    or not a regular file (a FIFO would block the read)."""
    try:
        with open_binary(path) as f:
            first = f.readline(MAX_HEADER)
    except OSError:
        return None
    return first if first.endswith(b"\n") else None


def read_header(path: str) -> RunHeader | None:
    """The header of ``path``, typed; None when it is missing, not yet whole, or not a header. A header
    whose world size or schema is damaged raises :class:`RankmemError` (as :func:`read_run` does)."""
    first = read_header_line(path)
    if first is None:
        return None
    try:
        obj = json.loads(first)
    except _BAD_JSON:
        return None
    if not isinstance(obj, dict) or obj.get("kind") != HEADER_KIND:
        return None
    return header_from_json(obj, path)


def _step(line: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(line)
    except _BAD_JSON:
        return None
    # A step line with its per-rank values (schema 1, inline) or with the aggregates alone (schema 2).
    # What the reader counts as corrupt is skipped here too: a step that is not an integer, a "ranks"
    # or "metrics" that is there but not an object.
    if not isinstance(obj, dict) or obj.get("kind") != STEP_KIND or type(obj.get("step")) is not int:
        return None
    ranks, metrics = obj.get("ranks"), obj.get("metrics")
    if not (isinstance(ranks, dict) or isinstance(metrics, dict)):
        return None
    if ("ranks" in obj and not isinstance(ranks, dict)) or ("metrics" in obj and not isinstance(metrics, dict)):
        return None
    return obj


def read_last_steps(path: str, count: int = 2, size: int | None = None) -> tuple[list[dict[str, Any]], int]:
    """The last ``count`` whole step lines of ``path`` (oldest first) and the bytes read to find them.

    ``size``: read as if the file ended there (a caller that has just stat'ed it). Corrupt lines and the
    header are skipped; fewer than ``count`` come back when the log has fewer.
    """
    with open_binary(path) as f:
        end = os.fstat(f.fileno()).st_size if size is None else size
        block = FIRST_BLOCK
        while True:
            start = max(0, end - block)
            f.seek(start)
            data = f.read(end - start)
            # Cut what follows the last newline (a line being written) and, unless this is the file's
            # start, the first piece (a line cut by the block's start).
            cut = data.rfind(b"\n")
            lines = data[: cut + 1].split(b"\n")[:-1] if cut >= 0 else []
            if start > 0 and lines:
                lines = lines[1:]
            steps: list[dict[str, Any]] = []
            for line in reversed(lines):
                step = _step(line)
                if step is not None:
                    steps.append(step)
                    if len(steps) == count:
                        break
            if len(steps) == count or start == 0 or block >= MAX_BLOCK:
                return steps[::-1], len(data)
            block *= 2


@dataclass
class Tail:
    """What :class:`TailFollower` last saw."""

    header: RunHeader | None = None
    header_error: RankmemError | None = None
    """Why the header line, though whole, cannot be read (a damaged world size): the caller says so."""
    steps: list[dict[str, Any]] = field(default_factory=list)
    """The newest step lines, oldest first."""
    size: int = 0
    bytes_read: int = 0
    """Bytes the last read took (0 when the file had not changed)."""


class TailFollower:
    """Follows one run log: :meth:`poll` returns the header and newest step lines, re-reading only what
    changed (nothing when the size and identity are the same as last time)."""

    def __init__(self, path: str, count: int = 2) -> None:
        self.path = path
        self.count = count
        self._identity: tuple[int, int] | None = None
        self.tail = Tail()

    def poll(self) -> Tail:
        try:
            st = os.stat(self.path)
        except OSError:  # not written yet, or moved aside and not yet recreated
            self._identity, self.tail = None, Tail()
            return self.tail
        identity = (st.st_dev, st.st_ino)
        if identity != self._identity or st.st_size < self.tail.size:
            self._identity, self.tail = identity, Tail()
            self._read_header()
        elif self.tail.header is None:
            self._read_header()
        if st.st_size == self.tail.size:
            self.tail.bytes_read = 0
            return self.tail
        try:
            steps, nread = read_last_steps(self.path, self.count, st.st_size)
        except OSError:
            return self.tail
        self.tail.steps, self.tail.size, self.tail.bytes_read = steps, st.st_size, nread
        return self.tail

    def _read_header(self) -> None:
        try:
            self.tail.header, self.tail.header_error = read_header(self.path), None
        except RankmemError as exc:
            self.tail.header, self.tail.header_error = None, exc
