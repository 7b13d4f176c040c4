"""The node, cgroup and children figures, read on a thread of their own and handed over with their age.

These figures describe the node and this rank's workers, not the window, so no edge reads them: a
daemon thread reads them every ``refresh_s`` seconds and a collect takes the last reading;
``mem/node/age_s`` says how old it was. The caller's thread reads for itself where no reading can be
handed over: the first collect, a forked child, a reading that failed (its error reaches the caller's
guard) and ``refresh_s=None``.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable

from rankmem.core.guard import Guard
from rankmem.core.records import HostReading

Read = Callable[[], HostReading]


class NodeFigures:
    """``read()`` on the caller's thread returns the last reading and its age in seconds."""

    def __init__(self, read: Read, refresh_s: float | None, guard: Guard) -> None:
        self._read = read
        self._refresh_s = refresh_s
        self._guard = guard
        self._latest: tuple[HostReading, float] | None = None  # the reading, time.monotonic() at its read
        self._pid = os.getpid()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._release: Callable[[], None] | None = None  # set by close(): whoever finishes last calls it
        self._releasing = threading.Lock()

    def read(self) -> tuple[HostReading, float]:
        """The last reading the thread took and its age; where there is none, one read now (age 0)."""
        latest = self._latest
        if latest is not None and self._pid == os.getpid():
            return latest[0], max(time.monotonic() - latest[1], 0.0)
        reading = self._read()  # raises as a read always did: the caller's guard says so
        if self._refresh_s is not None and self._thread is None and not self._stop.is_set():
            self._pid = os.getpid()
            self._latest = (reading, time.monotonic())
            # The thread holds the figures weakly: a Monitor dropped without close() ends it too.
            self._thread = threading.Thread(target=_serve, args=(weakref.ref(self), self._stop, self._refresh_s),
                                            name="rankmem-node", daemon=True)
            self._thread.start()
        return reading, 0.0

    def close(self, release: Callable[[], None], timeout: float = 2.0) -> None:
        """Stop the thread, then ``release()`` the probe's descriptors; where the thread is still inside
        a read after ``timeout`` s, the thread releases them when that read returns (closed under it,
        their numbers could go to another file it would then read)."""
        thread = self._thread
        if thread is None or self._pid != os.getpid():
            # No thread, or a forked child's copy of the parent's: that thread is not in this process,
            # and its Event's lock may have been copied held.
            release()
            return
        self._release = release
        self._stop.set()
        thread.join(timeout)
        if not thread.is_alive():
            self._release_once()

    def _release_once(self) -> None:
        with self._releasing:
            release, self._release = self._release, None
        if release is not None:
            release()


def _serve(ref: weakref.ref[NodeFigures], stop: threading.Event, refresh_s: float) -> None:
    """The thread: a reading every ``refresh_s`` until stopped, the figures dropped, or a read failed."""
    node = ref()
    if node is None:
        return
    guard, read = node._guard, node._read
    del node
    try:  # telemetry never kills training: a failed read warns once and ends the thread
        with guard.contain("node", "the node figures' thread stopped; each collect reads them itself"):
            while not stop.wait(refresh_s):
                reading = read()
                node = ref()
                if node is None:
                    return
                node._latest = (reading, time.monotonic())
                del node
    finally:
        node = ref()
        if node is not None:
            node._latest = None  # the caller's thread reads for itself from now on, its guard the judge
            if stop.is_set():
                node._release_once()  # a close() that stopped waiting for this read left it to us
