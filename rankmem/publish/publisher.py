"""The logging rank's side of a collect: the run header, the sinks and the online leak watch.

Nothing here communicates; every rank builds a :class:`Publisher` (so a bad sink is the same error
everywhere, at construction, never one rank raising inside a collective sequence), and only the
logging rank opens it.

Off the training thread: after the collective, the caller needs only the aggregated dict. Building
the per-rank record, encoding it, writing the sinks and the leak watch run on one background thread
fed by a bounded queue. If the sinks fall behind (a tracker in a network stall), the oldest pending
record is dropped, counted and warned about once: training is never blocked. :meth:`Publisher.flush`
waits for the queue to drain; ``close()`` and interpreter exit flush.

The training thread only appends to the queue; it does not wake the thread. Waking it every collect
cost the training thread ~20-120 us on a 2-core machine (the futex wake, and the woken thread taking
the CPU and contending for the GIL right inside the caller's step; bench/RESULTS.md, issue 14 item 4):
the thread instead looks at the queue every :data:`Publisher.POLL_S` seconds; a flush, or a queue
half full (collects faster than one per 0.4 ms), wakes it at once.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

from rankmem.core.guard import Guard
from rankmem.core.records import RunHeader, StepRecord
from rankmem.core.warnings import WarnOnce, warn
from rankmem.exchange.aggregate import Gathered
from rankmem.sinks import SafeSink, Sink

_Item = tuple[int, float, Gathered, dict[str, float]] | RunHeader


class Publisher:
    """Writes each collect's record to the sinks and feeds the leak watch, on the logging rank."""

    MAX_PENDING = 256
    """Records waiting for the sinks before the oldest is dropped (about 256 steps of a stalled tracker)."""
    FLUSH_TIMEOUT_S = 30.0
    POLL_S = 0.1
    """How often the background thread looks for records: the most the sinks lag behind a collect."""

    def __init__(self, sinks: Sequence[Sink], leak_check: bool, guard: Guard, background: bool = True) -> None:
        self._sink_objects = list(sinks)
        self._sinks: list[SafeSink] = []
        self._leak_check = leak_check
        self._leak_watch: Any = None
        self._guard = guard
        self._background = background
        self._pending: deque[_Item] = deque()
        self._wake = threading.Condition()
        self._busy = False
        self._flush_sinks = False
        self._thread: threading.Thread | None = None
        self._sync = threading.RLock()  # without the thread: one caller at a time in _handle (a flush
        # from the near-OOM watch's thread must not run inside the training thread's write)
        self._pid = os.getpid()  # a forked child inherits this object, not its thread or its files' state
        self._closed = False
        self.dropped = 0
        """Records dropped because the sinks fell more than :data:`MAX_PENDING` behind."""
        self.opened = False
        self.header: RunHeader | None = None
        """The run header, on every rank once :meth:`start` has been given it."""

    def start(self, header: RunHeader, logging: bool) -> None:
        """At the first collect, on every rank: keep the header; the logging rank opens its sinks."""
        self.header = header
        if logging:
            self.open(header)

    def open(self, header: RunHeader) -> None:
        """On the logging rank, at the first collect: open every sink with the run header."""
        self.opened = True
        with _live_lock:
            _live.add(self)  # flushed at exit (and by flush_all), with or without the thread
        self._submit(header)

    def publish(self, step: int, when: float, gathered: Gathered, metrics: dict[str, float] | None = None) -> None:
        """Hand one collect to the sinks and the leak watch (on the background thread by default):
        ``metrics`` are the aggregates with what the facade derived from them (verl's keys; default
        the aggregates alone)."""
        self._submit((step, when, gathered, gathered.aggregated if metrics is None else metrics))

    def _submit(self, item: _Item) -> None:
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
                self._pending.popleft()
                self.dropped += 1
                if self.dropped == 1:
                    warn("rankmem: the sinks fall behind the training loop; the oldest pending records are "
                         "dropped (Publisher.dropped counts them) rather than blocking training", stacklevel=4)
            self._pending.append(item)
            if len(self._pending) >= self.MAX_PENDING // 2:
                self._wake.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rankmem-publish", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._pending:
                    if self._flush_sinks:  # asked by flush(): once the queue is empty, not a queue slot
                        self._flush_sinks = False
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
                    self._flush_sinks = False  # close() closes the sinks next, which writes what they hold
                    self._wake.notify_all()
                return
            # A bug in a record's encoding must not end the thread: flush() would wait for it in vain.
            self._guard.call("publish", "writing a record failed", self._handle, item, default=None)

    def _handle(self, item: _Item) -> None:
        if item is _FLUSH:
            for sink in self._sinks:
                sink.flush()
            return
        if isinstance(item, RunHeader):
            for sink_object in self._sink_objects:
                sink = SafeSink(sink_object)
                sink.open(item)
                self._sinks.append(sink)
            return
        step, when, gathered, metrics = item
        if self._leak_check:
            self._check_leaks(step, gathered)
        if self._sinks:
            # The matrix as it is: the run log's side file takes it whole, and a sink that wants
            # per-rank lists builds them (StepRecord.columns()).
            record = StepRecord(step, when, metrics, keys=gathered.keys, matrix=gathered.matrix)
            for sink in self._sinks:
                sink.write(record)

    def _check_leaks(self, step: int, gathered: Gathered) -> None:
        # Leak checking is advice: a failure turns it off, with one warning, and never reaches training.
        with self._guard.scope("leaks", "online leak check failed and is off"):
            if self._leak_watch is None:
                from rankmem.publish.leakwatch import LeakWatch

                self._leak_watch = LeakWatch()
            # The gathered matrix, not a StepRecord: the watch reads 3 columns, and building every
            # key's per-rank lists each collect would be wasted where no sink needs them. At large
            # worlds most collects carry no per-rank detail: the watch sees the detail collects only.
            if gathered.matrix is not None:
                self._leak_watch.feed_matrix(step, gathered.keys, gathered.matrix)
            return
        self._leak_check = False

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
            self._flush_sinks = True
            self._wake.notify_all()  # the thread may be between polls
            # A thread that has ended (close() is stopping it, on another thread) flushed on its way out.
            return self._wake.wait_for(
                lambda: (not self._pending and not self._busy and not self._flush_sinks) or not thread.is_alive(),
                timeout if timeout is not None else self.FLUSH_TIMEOUT_S)

    def close(self) -> None:
        """Flush, stop the thread, close the sinks; a second call (or one in a forked child) does nothing."""
        if self._closed or os.getpid() != self._pid:
            return
        if not self.flush():
            warn(f"rankmem: the sinks did not finish within {self.FLUSH_TIMEOUT_S:.0f} s; closing them anyway")
        if self._thread is not None and self._thread.is_alive():
            with self._wake:
                self._pending.append(_STOP)
                self._wake.notify()
            self._thread.join(self.FLUSH_TIMEOUT_S)
        with self._sync:  # without the thread, a flush from another thread (the near-OOM watch) waits
            self._closed = True
            with _live_lock:
                _live.discard(self)
            for sink in self._sinks:
                sink.close()
            self._sinks = []


_in_child = WarnOnce()  # once per forked child (keyed by its pid)
_STOP: Any = object()
_FLUSH: Any = object()
_live: weakref.WeakSet[Publisher] = weakref.WeakSet()
_live_lock = threading.Lock()  # flush_all may run on any thread (at exit, or a caller's)


def flush_all(timeout: float | None = None) -> bool:
    """Flush every open publisher in this process (see :meth:`Publisher.flush`), within ``timeout``
    seconds in all; False if one did not finish in time. Safe from any thread: the sinks are still
    written by each publisher's own thread. Runs at interpreter exit (a Ray actor that
    :meth:`~rankmem.ray.group.WorkerGroup.shutdown` asks to exit runs it too)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    done = True
    with _live_lock:
        publishers = list(_live)
    for publisher in publishers:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        done = publisher.flush(left) and done
    return done


def _forget_in_child() -> None:
    # A forked child (a dataloader worker) has copies of the publishers but not their threads; the lock
    # may have been held by a thread that does not exist here.
    global _live_lock
    _live_lock = threading.Lock()
    _live.clear()


os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _flush_at_exit() -> None:
    # A script that ends without Monitor.close() still gets its last records written.
    flush_all()
