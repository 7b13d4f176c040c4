"""The logging rank's side of a collect: the run header, the sinks and the online watches.

Nothing here communicates; every rank builds a :class:`Publisher` (so a bad sink is the same error
everywhere, at construction, never one rank raising inside a collective sequence), and only the
logging rank opens it. Every rank keeps its last collect (:attr:`Publisher.last_record`).

The records reach the sinks on a background thread (:mod:`rankmem.publish.handoff` says how, and
what a stalled tracker or a signal can cost); this module says what a record becomes there.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rankmem.core.catalogue import verl_metrics
from rankmem.core.guard import Guard
from rankmem.core.records import RunHeader, StepRecord
from rankmem.publish import signals as _signals
from rankmem.publish.handoff import Handoff
from rankmem.sinks import SafeSink, Sink

if TYPE_CHECKING:
    from rankmem.exchange.aggregate import Gathered

_Collect = tuple[int, float, "Gathered", dict[str, float]]


class Publisher(Handoff):
    """Writes each collect's record to the sinks and feeds the leak watch, on the logging rank.

    ``verl_keys``: what :meth:`deliver` publishes includes verl's ``perf/*`` names for the aggregates."""

    def __init__(self, sinks: Sequence[Sink], leak_check: bool, guard: Guard, background: bool = True,
                 verl_keys: bool = False) -> None:
        super().__init__(guard, background)
        self._sink_objects = list(sinks)
        self._sinks: list[SafeSink] = []
        self._leak_check = leak_check
        self._leak_watch: Any = None
        self._advice_watch: Any = None
        self._ranks_per_node = 1
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

    def _prime(self) -> None:
        with self._guard.contain("prime", "priming the online watches failed"):
            import rankmem.exchange.exchange  # noqa: F401  (numpy, for the first collect)
            from rankmem.fit import prime
            from rankmem.trend.stats import PAIRS_AT_LEAST, pairs

            prime()
            pairs(PAIRS_AT_LEAST)

    def start(self, header: RunHeader, logging: bool) -> None:
        """At the first collect, on every rank: keep the header; the logging rank opens its sinks. The
        priming is over by then (it has had the first step's time to finish)."""
        if self._primer is not None:
            self._primer.join(5.0)  # pure computation: a stall here would be a bug, never a wait for a rank
        self.header = header
        if logging:
            self.open(header)

    def open(self, header: RunHeader) -> None:
        """On the logging rank, at the first collect: open every sink with the run header."""
        self.opened = True
        hosts = [r.host for r in header.ranks]
        self._ranks_per_node = max((hosts.count(h) for h in set(hosts)), default=1)
        with _live_lock:
            _live.add(self)  # flushed at exit (and by flush_all), with or without the thread
        _signals.install(flush_all)
        self._submit(header)

    def deliver(self, step: int, when: float, gathered: Gathered) -> dict[str, float]:
        """A collect's result, on every rank: kept as :attr:`last_record`, and published where this rank
        opened the sinks. Returns what is published (the aggregates, and verl's names for them if asked)
        as the caller's own copy: the sinks write theirs later, on their thread."""
        aggregated = gathered.aggregated
        metrics = {**aggregated, **verl_metrics(aggregated)} if self._verl_keys else dict(aggregated)
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
        self._submit((step, when, gathered, gathered.aggregated if metrics is None else metrics))

    def _write(self, item: _Collect | RunHeader) -> None:
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

                self._advice_watch = AdviceWatch(self._ranks_per_node)
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
