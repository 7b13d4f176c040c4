"""Appending a whole record to a run-log file, or nothing of it: shared by the lines and the side file."""

from __future__ import annotations

import errno
import os


def append_whole(fd: int, data: bytes | memoryview, size: int, path: str) -> int:
    """Write ``data`` to ``fd`` (opened with O_APPEND, ``size`` bytes of whole records so far); return
    the bytes written. A regular file takes it all in one ``write(2)``, except when the disk fills: then
    whatever part went in is cut off again (the next record starts where this one did) and the OSError
    is raised, so that the file never holds half a record followed by whole ones."""
    view = memoryview(data)
    done = 0
    try:
        while done < len(view):
            n = os.write(fd, view[done:])
            if n == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
            done += n
    except OSError:
        if done:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass
        raise
    return done
