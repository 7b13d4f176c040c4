"""The one follower of a run still being written (``rankmem watch``): :meth:`Follower.poll` re-reads
only what changed. The newest step lines come from the log's end (a block, doubled until it holds
them), the newest per-rank values and gaps from the side-file records added since the last poll. What
follows the last newline or whole record is left for the next poll; a rotation is told by identity."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from rankmem.core.records import RunHeader
from rankmem.core.rundir import NotRegularFile, open_binary, open_regular
from rankmem.errors import RankmemError
from rankmem.offline import runlog as R
from rankmem.runlog.layout import FILE_HEADER

FIRST_BLOCK = 64 * 1024
MAX_BLOCK = 256 * 1024 * 1024
"""Reading back stops here: a log whose last N step lines do not fit in 256 MiB is not a run log."""


def read_last_steps(path: str, count: int = 2, size: int | None = None) -> tuple[list[dict[str, Any]], int]:
    """The last ``count`` whole step lines of ``path`` (oldest first) and the bytes read to find them;
    ``size``: read as if the file ended there. Corrupt lines and the header are skipped."""
    with open_binary(path) as f:
        end = os.fstat(f.fileno()).st_size if size is None else size
        block = FIRST_BLOCK
        while True:
            start = max(0, end - block)
            f.seek(start)
            data = f.read(end - start)
            # Cut a line being written (after the last newline) and, but at the file's start, one cut by the block.
            cut = data.rfind(b"\n")
            lines = data[: cut + 1].split(b"\n")[:-1] if cut >= 0 else []
            lines = lines[1:] if start > 0 else lines
            steps: list[dict[str, Any]] = []
            for line in reversed(lines):
                step = R.step_of(line)
                if step is not None and isinstance(step.get("metrics"), dict):
                    steps.append(step)
                    if len(steps) == count:
                        break
            if len(steps) == count or start == 0 or block >= MAX_BLOCK:
                return steps[::-1], len(data)
            block *= 2


@dataclass
class Tail:
    """What :class:`Follower` last saw: ``header_error`` (a whole header line that cannot be read),
    ``steps`` (the newest step lines, oldest first), ``bytes_read`` (0: unchanged), ``detail`` (the side
    file's newest step and per-key, per-rank values), ``gaps``, and ``note`` (why the side file is not
    followed, or disagrees with the lines)."""

    header: RunHeader | None = None
    header_error: RankmemError | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    size: int = 0
    bytes_read: int = 0
    detail: tuple[int, dict[str, list[float | None]]] | None = None
    gaps: list[R.Gap] = field(default_factory=list)
    note: str | None = None


class Follower:
    """Follows one run log and its side file: :meth:`poll` returns a :class:`Tail`."""

    def __init__(self, path: str, count: int = 2) -> None:
        self.path = path
        self.count = count
        self._identity: tuple[int, int] | None = None
        self._side_identity: tuple[int, int] | None = None
        self._side: R.SideFile | None = None
        self.tail = Tail()

    def poll(self) -> Tail:
        try:
            st = os.stat(self.path)
        except OSError:  # not written yet, or moved aside and not yet recreated
            self._identity, self.tail, self._side = None, Tail(), None
            return self.tail
        if (st.st_dev, st.st_ino) != self._identity or st.st_size < self.tail.size:
            self._identity, self.tail, self._side = (st.st_dev, st.st_ino), Tail(), None
        if self.tail.header is None:
            self._read_header()
        if st.st_size != self.tail.size:
            try:
                steps, nread = read_last_steps(self.path, self.count, st.st_size)
                self.tail.steps, self.tail.size, self.tail.bytes_read = steps, st.st_size, nread
            except OSError:
                pass
        else:
            self.tail.bytes_read = 0
        if self.tail.header is not None:
            self._poll_side(self.tail.header)
            self._check_lines()
        return self.tail

    def _check_lines(self) -> None:
        """JSON has no checksum: the lines of the side file's newest collects must say its step and time
        (a damaged line would be drawn as the truth), each read where the side file says it starts."""
        side = self._side
        if side is None or not side.offsets or self.tail.note is not None:
            return
        try:
            with open_binary(self.path) as f:
                for step, when, offset in zip(side.steps[-2:], side.times[-2:], side.offsets[-2:], strict=True):
                    if offset >= self.tail.size:
                        continue  # its line is not written yet
                    f.seek(offset)
                    line = f.readline(MAX_BLOCK)
                    obj = (R.step_of(line) if line.endswith(b"\n") else None) or {"step": None}
                    written = obj.get("time")
                    if obj["step"] != step or not (written == when or (written is None and when != when)):
                        self.tail.note = (f"{self.path}: the line of step {step} (at byte {offset}) disagrees with "
                                          "the side file: a damaged line")
                        return
                # The side file's record comes before its line: a step line past the newest record's
                # (within the size read before the side file) says the side file is cut or damaged.
                if R.unheld(f.read(max(0, min(self.tail.size - f.tell(), 1 << 20))).split(b"\n")[:-1]):
                    self.tail.note = (f"{self.path}: the run log goes on past step {side.steps[-1]}, the side "
                                      "file's newest record: the side file is cut or damaged")
        except OSError:
            return

    def _read_header(self) -> None:
        first = R.read_header_line(self.path)
        try:
            self.tail.header, self.tail.header_error = R.parse_header(first or b"", self.path), None
        except R.NoHeader:
            pass  # not (yet) a header: watch says so, from the lines
        except RankmemError as exc:
            self.tail.header, self.tail.header_error = None, exc

    def _poll_side(self, header: RunHeader) -> None:
        path = R.side_path_of(self.path)
        try:
            fd = open_regular(path)
        except NotRegularFile as exc:
            self.tail.note = str(exc)
            return
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and self.tail.steps:
                self.tail.note = f"{path} is missing: no per-rank values"
            return
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self._side_identity:
            self._side_identity, self._side = (st.st_dev, st.st_ino), None
        side = self._side
        if st.st_size < FILE_HEADER.size or (side is not None and (side.damaged or st.st_size == side.end)):
            os.close(fd)
            return
        with R.mapped(fd, st.st_size) as view:
            if side is None:
                head = bytes(view[: FILE_HEADER.size])
                self.tail.note = R.check_file_header(head, path, header) or R.header_note(
                    head, path, R.read_header_line(self.path))
                if self.tail.note is not None:
                    return
                side = self._side = R.SideFile(header.world_size)
            self._take(side, view, st.st_size)

    def _take(self, side: R.SideFile, view: memoryview, size: int) -> None:
        """Walk the new records; keep the newest per-rank values and the gaps (the lists stay short)."""
        R.walk(view, size, side)
        if side.runs:
            first, count, start, stride, key_set = side.runs[-1]
            at, keys = start + (count - 1) * stride, side.key_sets[key_set]
            flat = view[at : at + 8 * side.world * len(keys)].cast("d").tolist()  # rank-major
            self.tail.detail = (side.steps[first + count - 1],
                                {k: [None if v != v else v for v in flat[j :: len(keys)]] for j, k in enumerate(keys)})
        self.tail.gaps = list(side.gaps)
        if side.damaged:
            self.tail.note = f"{self.path}: the side file: {side.damaged}; not followed further"
        del side.steps[:-2], side.times[:-2], side.offsets[:-2], side.runs[:]
