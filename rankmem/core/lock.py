"""One writer per run directory: an exclusive ``flock`` on ``<dir>/.lock``.

Two jobs given the same ``--out`` at the same instant both moved the old log aside and both wrote
``rankmem.jsonl``; one job's lines were overwritten by the other's (issue 11). The lock makes the second
job refuse instead. ``rankmem train`` takes it before torchrun starts and holds it for the whole job;
the run-log writer on the logging rank takes it when it opens, unless the launcher that started it holds
it already (:data:`ENV_HELD`: a second ``open`` of the file in the rank would conflict with the
launcher's own lock, flock being per open file description).

``flock`` is released by the kernel when the holder exits, however it exits (SIGKILL, OOM), so a dead
job never leaves a stale lock. On NFS, Linux emulates it with byte-range locks, which the server
arbitrates between nodes. The file itself stays behind (removing it on release would let a third job
lock a fresh inode while a second still waits on the old one).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time

from rankmem.core.rundir import ENV_HELD, LOCK_NAME, NotRegularFile, open_regular
from rankmem.core.warnings import warn
from rankmem.errors import RankmemError

__all__ = ["ENV_HELD", "LOCK_NAME", "RunDirLock"]

_HOLDER_BYTES = 256


class RunDirLock:
    """The exclusive lock on ``directory``; :meth:`acquire` creates the directory and never blocks."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.abspath(os.path.join(directory, LOCK_NAME))
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`RankmemError` naming the job that holds it, or why the
        directory cannot be written. A no-op when already held."""
        if self._fd is not None:
            return
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            raise RankmemError(f"{self.directory}: cannot create the run directory ({exc.strerror or exc})") from None
        try:
            try:
                fd = open_regular(self.path, os.O_RDWR | os.O_CREAT)
            except NotRegularFile as exc:
                if exc.kind != "a symbolic link":
                    raise
                # A link planted in a shared directory: never followed; the link goes, its target stays.
                warn(f"rankmem: {self.path} is a symbolic link: removed (its target untouched) and a lock "
                     "file made in its place")
                os.unlink(self.path)
                fd = open_regular(self.path, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            raise RankmemError(f"{self.directory}: cannot write in the run directory ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RankmemError(
                    f"{self.directory} is in use by another rankmem job ({holder or 'holder unknown'} holds "
                    f"{self.path}): two jobs writing one run directory overwrite each other's log; wait for "
                    "it to end or choose another run directory"
                ) from None
            raise RankmemError(f"{self.directory}: cannot lock the run directory ({exc.strerror or exc})") from None
        # Who holds it, for the message of a job that is refused: one fixed-width pwrite, so that a
        # reader sees the old holder or the new one, never a mix (best effort: a full disk may refuse).
        holder = f"pid {os.getpid()} on {socket.gethostname()}"[: _HOLDER_BYTES - 1]
        try:
            os.pwrite(fd, holder.encode().ljust(_HOLDER_BYTES - 1) + b"\n", 0)
        except OSError:
            pass
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor of the open file drops the flock
            self._fd = None


def _read_holder(fd: int) -> str:
    # A job that starts at the same instant as the holder can read the file between the holder's
    # flock and its pwrite: wait a little for the name (a few ms at most in practice).
    for _ in range(20):
        try:
            text = os.pread(fd, _HOLDER_BYTES, 0).decode("utf-8", "replace").strip()
        except OSError:
            return ""
        if text:
            return text
        time.sleep(0.01)
    return ""
