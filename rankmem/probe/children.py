"""Private memory (USS) of this process's descendants, read off the training thread.

A forked dataloader worker's RSS counts every parent page it touches copy-on-write, so summed child RSS
counts the parent once per worker. What a worker adds is its private memory (``Private_*`` of
``/proc/PID/smaps_rollup``), which the kernel computes by walking every mapping: too slow for the
training thread, so a daemon thread re-reads it every ``refresh_s`` seconds and a collect picks up the
last sum. The first read is on the caller's thread, once, so every rank reports the key from its first
collect on (a key appearing later on some ranks would change the gathered layout).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from rankmem.core.guard import Guard
from rankmem.probe import procfs as _procfs

_ROLLUP_BUF = 4096  # smaps_rollup is ~1 KB


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(_ROLLUP_BUF)
    except OSError:  # the child exited between the listing and the read
        return None


class ChildrenUss:
    """Summed USS of the processes ``descendants()`` lists, refreshed on a daemon thread."""

    def __init__(self, descendants: Callable[[], set[int]], refresh_s: float, proc: str = "/proc") -> None:
        self._descendants = descendants
        self._refresh_s = refresh_s
        self._proc = proc
        self._value: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._guard = Guard()
        self._warn_once = self._guard.warn_once
        self.supported = os.path.exists(f"{proc}/self/smaps_rollup")  # exists, unread: reading it costs ms
        """False on kernels without ``smaps_rollup`` (Linux < 4.14): the figure is then unavailable."""
        self.pass_s = 0.0
        """Wall time of the last pass (listing and reading every descendant), for the bench."""

    def value(self) -> int | None:
        """The last sum in bytes (0 without descendants); ``None`` on a kernel without ``smaps_rollup``.
        The first call reads now, on the caller's thread, and starts the refresh thread."""
        if not self.supported:
            self._warn_once("rollup", "no /proc/PID/smaps_rollup (Linux < 4.14): mem/host/children_uss_gib is "
                                      "unavailable")
            return None
        if self._thread is None and not self._stop.is_set():
            self._pass()
            self._thread = threading.Thread(target=self._run, name="rankmem-children-uss", daemon=True)
            self._thread.start()
        return self._value

    def _run(self) -> None:
        while not self._stop.wait(self._refresh_s):
            with self._guard.scope("pass", "reading the private memory of child processes failed"):
                self._pass()

    def _pass(self) -> None:
        start = time.perf_counter()
        total = 0
        for pid in self._descendants():
            data = _read(f"{self._proc}/{pid}/smaps_rollup")
            uss = None if not data else _procfs.parse_uss(data)  # None: the child exited meanwhile
            total += uss or 0
        self._value = total
        self.pass_s = time.perf_counter() - start

    def close(self, timeout: float = 1.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
