"""What the Hugging Face and Lightning callbacks share: a monitor built on first use, the phase
window held open between a framework's step-begin and step-end hooks, and the filter on which
aggregated keys reach the framework's logs."""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

from rankmem.monitor import Monitor


class StepWindow:
    """Mixin for a framework callback; call :meth:`_setup_window` from its ``__init__``.

    A framework reports a step as two hook calls, not a ``with`` block, so the phase is entered at the
    first and held in an ``ExitStack`` until the second.
    """

    monitor: Monitor | None
    step_phase: str | None

    def _setup_window(self, monitor: Monitor | None, step_phase: str | None, options: dict[str, Any],
                      log_keys: Sequence[str] | None = None) -> None:
        self.monitor = monitor
        self.step_phase = step_phase
        if isinstance(log_keys, str):
            log_keys = (log_keys,)
        self.log_keys = tuple(log_keys) if log_keys is not None else None
        # Trackers are the framework's job: no sinks and no verl keys unless the caller asks.
        self._options: dict[str, Any] = {"sinks": (), "verl_keys": False, **options}
        self._owns_monitor = monitor is None
        self._step: contextlib.ExitStack | None = None

    def _for_logs(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """The aggregates that go to the framework's logs: those matching a ``log_keys`` pattern
        (``fnmatch``: ``mem/host/peak_rss_gib/*``), all of them without one. Every rank still measures
        every key, and the run log (``sinks=("jsonl",)``) keeps them all."""
        if self.log_keys is None:
            return dict(metrics)
        return {k: v for k, v in metrics.items() if any(fnmatch.fnmatchcase(k, p) for p in self.log_keys)}

    def _monitor(self) -> Monitor:
        """The monitor, built on first use: after the framework has initialised the process group."""
        if self.monitor is None:
            self.monitor = Monitor(**self._options)
        return self.monitor

    def _open_step(self, step: int) -> None:
        """Name the step in progress (``step``: the number its collect will log), then enter the step's
        phase, first closing one left open by a step that never reported its end."""
        self._monitor().set_step(step)
        if self.step_phase is None:
            return
        self._close_step()
        self._step = contextlib.ExitStack()
        self._step.enter_context(self._monitor().phase(self.step_phase))

    def _close_step(self, exc: BaseException | None = None) -> None:
        """Leave the step's phase; with ``exc`` (a framework's exception hook), as that exception would
        leave a ``with`` block: an out-of-memory error becomes an ``oom`` event at this step and phase."""
        if self._step is not None:
            step, self._step = self._step, None
            if exc is None:
                step.close()
            else:
                step.__exit__(type(exc), exc, exc.__traceback__)  # re-raises nothing: the framework does
        elif exc is not None and self.monitor is not None:
            self.monitor.record_oom(exc)

    def _close_monitor(self) -> None:
        """Close the monitor if this callback built it; one passed in belongs to the caller."""
        if self._owns_monitor and self.monitor is not None:
            self.monitor.close()
            # A later evaluate()/fit() on the same callback builds a fresh monitor on every rank.
            self.monitor = None
