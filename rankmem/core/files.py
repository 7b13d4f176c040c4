"""Opening a file rankmem reads, when it may not be a regular file at all.

A FIFO where a run log, side file, event log or heartbeat is expected blocks a plain ``open()`` until
a writer appears, which may be never (``rankmem report`` and ``watch`` hung so); a character device
(``/dev/zero``) reads without end. So every reader opens with ``O_NONBLOCK`` (a FIFO then opens at
once, a socket refuses with ENXIO) and ``O_NOCTTY``, and checks with ``fstat`` that what it opened is a
regular file before reading a byte. For a regular file ``O_NONBLOCK`` changes nothing.
"""

from __future__ import annotations

import io
import os
import stat

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))


class NotRegularFile(OSError):
    """What a reader opened (or found) is not a regular file; its message says what it is."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(f"{path} is {kind}, not a regular file; skipped")
        self.path = path  # not OSError's filename: with it set, str() would read "[Errno None] None: ..."
        self.kind = kind


def kind_of(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str) -> int:
    """A read-only descriptor of ``path``; :class:`NotRegularFile` (an OSError) when it is not a regular
    file, OSError when it cannot be opened (a socket says ENXIO)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    regular = False
    try:
        mode = os.fstat(fd).st_mode
        regular = stat.S_ISREG(mode)
        if not regular:
            raise NotRegularFile(path, kind_of(mode))
    finally:
        if not regular:
            os.close(fd)
    return fd


def open_binary(path: str) -> io.BufferedReader:
    """``open(path, "rb")``, through :func:`open_regular`."""
    return io.open(open_regular(path), "rb")  # noqa: UP020 - typed as a BufferedReader, which peeks


def is_regular(path: str) -> bool:
    """Whether ``path`` is a regular file (not following what it is: ``os.stat`` never blocks)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def read_bytes(path: str, limit: int | None = None) -> bytes:
    """The file's bytes (at most ``limit``), through :func:`open_regular`."""
    with open_binary(path) as f:
        return f.read() if limit is None else f.read(limit)
