"""The logging rank's side of a collect: the run header, the sinks and the online leak watch.

Nothing here communicates; every rank builds a :class:`Publisher` (so a bad sink is the same error
everywhere, at construction, never one rank raising inside a collective sequence), and only the
logging rank opens it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rankmem._collective import Gathered
from rankmem._guard import Guard
from rankmem._records import RunHeader, StepRecord
from rankmem.sinks import SafeSink, Sink


class Publisher:
    """Writes each collect's record to the sinks and feeds the leak watch, on the logging rank."""

    def __init__(self, sinks: Sequence[Sink], leak_check: bool, guard: Guard) -> None:
        self._sink_objects = list(sinks)
        self._sinks: list[SafeSink] = []
        self._leak_check = leak_check
        self._leak_watch: Any = None
        self._guard = guard
        self.opened = False

    def open(self, header: RunHeader) -> None:
        """On the logging rank, at the first collect: open every sink with the run header."""
        self.opened = True
        for sink_object in self._sink_objects:
            sink = SafeSink(sink_object)
            sink.open(header)
            self._sinks.append(sink)

    @property
    def wants_record(self) -> bool:
        return bool(self._sinks)

    def publish(self, step: int, gathered: Gathered, record: StepRecord | None) -> None:
        """Feed the leak watch the gathered matrix and write ``record`` to every sink."""
        if self._leak_check:
            self._check_leaks(step, gathered)
        if record is not None:
            for sink in self._sinks:
                sink.write(record)

    def _check_leaks(self, step: int, gathered: Gathered) -> None:
        # Leak checking is advice: a failure turns it off, with one warning, and never reaches training.
        with self._guard.scope("leaks", "online leak check failed and is off"):
            if self._leak_watch is None:
                from rankmem._trend import LeakWatch

                self._leak_watch = LeakWatch()
            # The gathered matrix, not a StepRecord: the watch reads 3 columns, and building every
            # key's per-rank lists each collect would be wasted where no sink needs them.
            self._leak_watch.feed_matrix(step, gathered.keys, gathered.matrix)
            return
        self._leak_check = False

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []
