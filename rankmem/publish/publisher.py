"""The logging rank's side of a collect: the run header, the sinks and the online watches.

Nothing here communicates; every rank builds a :class:`Publisher` (so a bad sink is the same error
everywhere, at construction, never one rank raising inside a collective sequence), and only the
logging rank opens it. Every rank keeps its last collect (:attr:`Publisher.last_record`).

The records reach the sinks on a background thread (:mod:`rankmem.publish.handoff` says how, and
what a stalled tracker or a signal can cost); this module says what a record becomes there. The run
log has a queue and a thread of its own (:class:`RunLogQueue`): a tracker that stalls, raises or is slow
sheds its own records, never the run log's; what the run log itself must drop (a loop faster than the
disk) is named in its gap record.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from rankmem.core.catalogue import verl_metrics
from rankmem.core.guard import Guard
from rankmem.core.records import RunHeader, StepRecord
from rankmem.publish import signals as _signals
from rankmem.publish.handoff import Handoff
from rankmem.runlog.writer import RunLogWriter
from rankmem.sinks import SafeSink, Sink

if TYPE_CHECKING:
    from rankmem.exchange.aggregate import Gathered

_Collect = tuple[int, float, "Gathered", dict[str, float]]


def _opened(sink_objects: Sequence[Any], header: RunHeader) -> list[SafeSink]:
    """Each sink wrapped and opened with the run header (a failure is the wrapper's to retry)."""
    sinks = [SafeSink(s) for s in sink_objects]
    for sink in sinks:
        sink.open(header)
    return sinks


class RunLogQueue(Handoff):
    """The run log's own queue and thread: it writes the run-log sinks alone."""

    MAX_PENDING = 4096
    """Collects waiting for the disk before the oldest is dropped, and named in a gap record."""

    def __init__(self, sinks: Sequence[RunLogWriter], guard: Guard, background: bool) -> None:
        super().__init__(guard, background)
        self._sink_objects = list(sinks)
        self._sinks: list[SafeSink] = []
        self._lost: tuple[int, int, int] | None = None  # first, last, count dropped since the last write

    def _dropped(self, item: Any) -> None:
        if isinstance(item, tuple):
            step = item[0]
            self._lost = (step, step, 1) if self._lost is None else (self._lost[0], step, self._lost[2] + 1)

    def _write(self, item: _Collect | RunHeader) -> None:
        if isinstance(item, RunHeader):
            self._sinks += _opened(self._sink_objects, item)
            return
        self._hand_lost()
        step, when, gathered, metrics = item
        record = StepRecord(step, when, metrics, keys=gathered.keys, matrix=gathered.matrix)
        for sink in self._sinks:
            sink.write(record)

    def _hand_lost(self) -> None:
        """The collects dropped from the queue since the last write, to the writers' pending gap."""
        with self._wake:
            lost, self._lost = self._lost, None
        if lost is None:
            return
        first, last, count = lost
        for sink in self._sinks:
            cast(RunLogWriter, sink.sink).lost(first, last, count, f"the run log's queue overran ({self.MAX_PENDING} "
                                                "collects behind: a loop faster than the disk)")

    def _flush_buffers(self) -> None:
        self._hand_lost()
        for sink in self._sinks:
            sink.flush()

    def _shut(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []


class Publisher(Handoff):
    """Writes each collect's record to the sinks and feeds the leak watch, on the logging rank.

    ``verl_keys``: what :meth:`deliver` publishes includes verl's ``perf/*`` names for the aggregates."""

    def __init__(self, sinks: Sequence[Sink], leak_check: bool, guard: Guard, background: bool = True,
                 verl_keys: bool = False) -> None:
        super().__init__(guard, background)
        self._sink_objects = [s for s in sinks if not isinstance(s, RunLogWriter)]
        logs = [s for s in sinks if isinstance(s, RunLogWriter)]
        self._run_log = RunLogQueue(logs, guard, background) if logs else None
        self._sinks: list[SafeSink] = []
        self._leak_check = leak_check
        self._leak_watch: Any = None
        self._advice_watch: Any = None
        self._verl_keys = verl_keys
        self._last: _Collect | None = None
        self._last_record: StepRecord | None = None
        self.header: RunHeader | None = None
        """The run header, on every rank once :meth:`start` has been given it."""
        self._primer: threading.Thread | None = None
        if leak_check:
            # The watches' first judgements leave ~2.7 MiB resident in the logging rank (numpy's code
            # pages and workspaces after a first fit, the leak statistics' index pairs): mid-run, in the
            # windows the advice fits read. Taken before the first collect on every rank, on a thread
            # while the first step runs, it is in every baseline and the ranks stay alike. Only memory
            # is at stake: a failure is one warning.
            self._primer = threading.Thread(target=self._prime, name="rankmem-prime", daemon=True)
            self._primer.start()

    def primed(self) -> None:
        """Wait for the priming, at the first window or collect: what it leaves is in no user's window."""
        if self._primer is not None:
            self._primer.join(5.0)  # pure computation: a stall here would be a bug, never a wait for a rank
            self._primer = None

    def _prime(self) -> None:
        time.sleep(0)  # the GIL back to the thread that started this one, at once: the Monitor() returns
        with self._guard.contain("prime", "priming the online watches failed"):
            import rankmem.exchange.exchange  # noqa: F401  (numpy, for the first collect)
            from rankmem.fit.pooled import prime
            from rankmem.trend.stats import PAIRS_AT_LEAST, pairs

            prime()
            pairs(PAIRS_AT_LEAST)

    def start(self, header: RunHeader, logging: bool) -> None:
        """At the first collect, on every rank: keep the header; the logging rank opens its sinks. The
        priming is over by then (it has had the first step's time to finish)."""
        self.primed()
        self.header = header
        if logging:
            self.open(header)

    def open(self, header: RunHeader) -> None:
        """On the logging rank, at the first collect: open every sink with the run header."""
        self.opened = True
        with _live_lock:
            _live.add(self)  # flushed at exit (and by flush_all), with or without the thread
        _signals.install(flush_all)
        if self._run_log is not None:
            self._run_log.opened = True
            self._run_log._submit(header)
        self._submit(header)

    def deliver(self, step: int, when: float, gathered: Gathered) -> dict[str, float]:
        """A collect's result, on every rank: kept as :attr:`last_record`, and published where this rank
        opened the sinks. Returns what is published (the aggregates, and verl's names for them if asked)
        as the caller's own copy: the sinks write theirs later, on their thread."""
        metrics = gathered.aggregated  # this collect's own: verl's keys added in place; the caller gets a copy
        metrics.update(verl_metrics(metrics) if self._verl_keys else ())
        self._last, self._last_record = (step, when, gathered, metrics), None
        if self.opened:
            self.publish(step, when, gathered, metrics)
        return dict(metrics)

    @property
    def last_record(self) -> StepRecord | None:
        """The last delivered collect's record, per-rank vectors included (built on first use)."""
        if self._last_record is None and self._last is not None:
            step, when, gathered, metrics = self._last
            self._last_record = StepRecord(step, when, metrics, gathered.columns())
        return self._last_record

    def publish(self, step: int, when: float, gathered: Gathered, metrics: dict[str, float] | None = None) -> None:
        """Hand one collect to the sinks and the leak watch (on the background thread by default):
        ``metrics`` are the aggregates with what was derived from them (verl's keys; default the
        aggregates alone)."""
        item = (step, when, gathered, gathered.aggregated if metrics is None else metrics)
        if self._run_log is not None:
            self._run_log._submit(item)
        if self._sink_objects or self._leak_check:
            self._submit(item)

    def settle(self) -> None:
        """The previous collect's run-log record on disk (and the other sinks', both bounded)."""
        if self._run_log is not None:
            self._run_log.settle()
        super().settle()

    RUN_LOG_SHARE = 0.8  # of a flush's or close's bound, the run log's most: a stuck disk leaves the trackers time

    def flush(self, timeout: float | None = None) -> bool:
        """Both queues flushed within ``timeout`` (default :data:`FLUSH_TIMEOUT_S`) in all; the run
        log's first, within :data:`RUN_LOG_SHARE` of it."""
        bound = self.FLUSH_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + bound
        done = self._run_log is None or self._run_log.flush(bound * self.RUN_LOG_SHARE)
        return super().flush(max(0.0, deadline - time.monotonic())) and done

    def close(self, timeout: float | None = None) -> bool:
        """Close both queues within ``timeout`` (default :data:`FLUSH_TIMEOUT_S`) in all: the run log's
        first, within :data:`RUN_LOG_SHARE` of it, and the rest in what time is left."""
        bound = self.FLUSH_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + bound
        done = self._run_log is None or self._run_log.close(bound * self.RUN_LOG_SHARE)
        return super().close(max(0.0, deadline - time.monotonic())) and done

    def _write(self, item: _Collect | RunHeader) -> None:
        if isinstance(item, RunHeader):
            self._sinks += _opened(self._sink_objects, item)
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

    def _flush_buffers(self) -> None:
        for sink in self._sinks:
            sink.flush()

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
                self._check_advice(step, gathered)
            return
        self._leak_check = False

    def _check_advice(self, step: int, gathered: Gathered) -> None:
        """The advice watch (phases told their micro-batches only): a failure turns it off, once."""
        if self._advice_watch is False or gathered.matrix is None:
            return
        with self._guard.scope("advice", "online advice watch failed and is off"):
            if self._advice_watch is None:
                from rankmem.publish.advicewatch import AdviceWatch

                hosts = [r.host or "?" for r in self.header.ranks] if self.header else []
                self._advice_watch = AdviceWatch(hosts)
            self._advice_watch.feed_matrix(step, gathered.keys, gathered.matrix)
            return
        self._advice_watch = False

    def _shut(self) -> None:
        with _live_lock:
            _live.discard(self)
            last = not _live
        if last:
            _signals.uninstall()
        for sink in self._sinks:
            sink.close()
        self._sinks = []


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
