"""How a collect's record leaves the training thread: a bounded queue and one background thread.

After the collective the caller needs only the aggregated dict; building the record, encoding it, the
sinks and the leak watch run on one background thread. If the sinks fall behind, the oldest pending
record is dropped, counted and warned about once: training is never blocked.

Nothing collected is lost at a signal: every collect wakes the thread, the next collect first waits
briefly (:data:`Handoff.SETTLE_S`) for the previous record (a sink slower than that is not waited for
again until it catches up), and SIGTERM / SIGINT / SIGHUP flush before they act
(:mod:`rankmem.publish.signals`). What becomes of an item is the subclass's business
(:class:`rankmem.publish.publisher.Publisher`). :meth:`Handoff.flush` and :meth:`Handoff.close` wait at
most :data:`Handoff.FLUSH_TIMEOUT_S` in all; a writer that makes no progress is left, a daemon thread,
and close() says what was not written.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any

from rankmem.core.guard import Guard
from rankmem.core.warnings import WarnOnce, warn


class Handoff:
    """Items handed from the training thread to one background thread, which gives each to
    :meth:`_write` (and asks :meth:`_flush_buffers` at a flush). Without ``background`` both run on the
    caller's thread, one caller at a time. Nothing is written before :attr:`opened` is set."""

    MAX_PENDING = 256
    """Records waiting for the sinks before the oldest is dropped (about 256 steps of a stalled tracker)."""
    FLUSH_TIMEOUT_S = 5.0
    """The most :meth:`flush` (by default) and :meth:`close` (in all) wait for the thread."""
    POLL_S = 1.0
    """How often the idle thread looks at its queue without being woken (a safety net only)."""
    SETTLE_S = 0.2
    """How long a collect waits for the previous collect's record to be written (see the module docstring)."""

    def __init__(self, guard: Guard, background: bool = True) -> None:
        self._guard = guard
        self._background = background
        self._pending: deque[Any] = deque()
        self._wake = threading.Condition()
        self._busy = False
        self._flush_asked = False
        self._thread: threading.Thread | None = None
        self._sync = threading.RLock()  # without the thread: one caller at a time in _handle (a flush
        # from the near-OOM watch's thread must not run inside the training thread's write)
        self._pid = os.getpid()  # a forked child inherits this object, not its thread or its files' state
        self._closed = False
        self._submitted = 0
        self._handled = 0
        self._lagging = False  # the last settle timed out: not waited for again until caught up
        self.dropped = 0
        """Records dropped because the sinks fell more than :data:`MAX_PENDING` behind."""
        self.opened = False

    def _write(self, item: Any) -> None:
        raise NotImplementedError

    def _flush_buffers(self) -> None:
        """What the writer buffers (the run log's per-rank batch) to disk."""

    def _dropped(self, item: Any) -> None:
        """``item`` was dropped from a full queue (called with the queue's lock held)."""

    def _shut(self) -> None:
        """The last step of :meth:`close`, the thread stopped: release what the writer holds."""

    def settle(self) -> None:
        """Wait (at most :data:`SETTLE_S`) until every record submitted so far is written: called by the
        next collect, so that a collect's record is on disk before the next collect returns."""
        if not self._background or self._thread is None or os.getpid() != self._pid:
            return
        with self._wake:
            if self._handled >= self._submitted:
                self._lagging = False
                return
            if self._lagging:
                return
            target = self._submitted
            if not self._wake.wait_for(lambda: self._handled >= target, self.SETTLE_S):
                self._lagging = True

    def _submit(self, item: Any) -> None:
        if os.getpid() != self._pid:  # a forked child: the thread and the files' state are the parent's
            _in_child(f"child:{os.getpid()}", "a record published in a forked child process is dropped (only "
                                              "the process that built the Monitor writes its sinks)")
            return
        if not self._background:
            with self._sync:
                self._handle(item)
            return
        with self._wake:
            if len(self._pending) >= self.MAX_PENDING:
                self._dropped(self._pending.popleft())
                self.dropped += 1
                self._handled += 1  # never to be written: nothing to wait for
                if self.dropped == 1:
                    warn("rankmem: the sinks fall behind the training loop; the oldest pending records are "
                         "dropped (Publisher.dropped counts them) rather than blocking training", stacklevel=4)
            self._pending.append(item)
            self._submitted += 1
            self._wake.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rankmem-publish", daemon=True)
            self._thread.start()

    def _handle(self, item: Any) -> None:
        if item is _FLUSH:
            self._flush_buffers()
        else:
            self._write(item)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._pending:
                    if self._flush_asked:  # asked by flush(): once the queue is empty, not a queue slot
                        self._flush_asked = False
                        self._pending.append(_FLUSH)
                        break
                    self._busy = False
                    self._wake.notify_all()  # flush() waits for an empty queue and an idle thread
                    self._wake.wait(self.POLL_S)
                item = self._pending.popleft()
                self._busy = True
            if item is _STOP:
                with self._wake:
                    self._busy = False
                    self._flush_asked = False  # close() closes the sinks next, which writes what they hold
                    self._wake.notify_all()
                return
            # A bug in a record's encoding must not end the thread: flush() would wait for it in vain.
            self._guard.call("publish", "writing a record failed", self._handle, item, default=None)
            if item is not _FLUSH:
                with self._wake:
                    self._handled += 1
                    self._wake.notify_all()  # a collect may be settling

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted record is written, and what the sinks buffer (the run log's
        per-rank batch) is on disk; False if ``timeout`` passed first. After :meth:`close`, and in a
        forked child (whose copy is not its to write), there is nothing to do."""
        if self._closed or os.getpid() != self._pid or not self.opened:
            return True
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            if not self._sync.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
                return False  # a write is still running on the training thread
            try:
                if not self._closed:  # close() may have run while this waited
                    self._handle(_FLUSH)
            finally:
                self._sync.release()
            return True
        with self._wake:
            self._flush_asked = True
            self._wake.notify_all()  # the thread may be between polls
            # A thread that has ended (close() is stopping it, on another thread) flushed on its way out.
            return self._wake.wait_for(
                lambda: (not self._pending and not self._busy and not self._flush_asked) or not thread.is_alive(),
                timeout if timeout is not None else self.FLUSH_TIMEOUT_S)

    def close(self, timeout: float | None = None) -> bool:
        """Flush, stop the thread, then :meth:`_shut`, within ``timeout`` (default
        :data:`FLUSH_TIMEOUT_S`) in all; False, with one warning, when the thread did not finish: it is
        left (a daemon) with what it holds. A second call (or one in a forked child) does nothing."""
        if self._closed or os.getpid() != self._pid:
            return True
        bound = self.FLUSH_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + bound
        self.flush(max(0.0, deadline - time.monotonic()))
        thread = self._thread
        if thread is not None and thread.is_alive():
            with self._wake:
                self._pending.append(_STOP)
                self._wake.notify()
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                self._closed = True
                with self._wake:
                    left = sum(1 for item in self._pending if item is not _STOP) + self._busy
                warn(f"rankmem: {type(self).__name__}'s writer did not finish within {bound:.0f} s of close(); "
                     f"{left} record(s) not written, the writer left behind")
                return False
        if not self._sync.acquire(timeout=max(0.0, deadline - time.monotonic())):
            self._closed = True
            return False
        try:  # without the thread, a flush from another thread (the near-OOM watch) waits
            self._closed = True
            self._shut()
        finally:
            self._sync.release()
        return True


_in_child = WarnOnce()  # once per forked child (keyed by its pid)
_STOP: Any = object()
_FLUSH: Any = object()
