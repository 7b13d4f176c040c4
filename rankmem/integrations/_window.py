"""What the Hugging Face and Lightning callbacks share: a monitor built on first use, the phase
window held open between a framework's step-begin and step-end hooks, the collect cadence (every
``every_n_steps`` optimizer steps, whatever the framework's own logging interval), a micro-batch's work
as the model computes on it, the framework named in the run log's header (``rankmem advise`` speaks its
settings), and the filter on which aggregated keys reach the framework's logs."""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

from rankmem.errors import RankmemError
from rankmem.monitor import Monitor


def computed_work(inputs: Any) -> tuple[int, int, int] | None:
    """A micro-batch's work as the model computes on it: (tokens, sequences, sum of squared lengths) of
    its 2-D ``input_ids`` (else ``attention_mask``): every position, padding included, since every layer
    runs on the padded width (SDPA and eager attention too); None where the inputs hold neither. Shapes
    only: no device read."""
    if not isinstance(inputs, Mapping):
        return None
    for name in ("input_ids", "attention_mask"):
        try:
            shape = tuple(getattr(inputs.get(name), "shape", ()))
            rows, width = (int(n) for n in shape) if len(shape) == 2 else (0, 0)
        except (TypeError, ValueError):  # a tensor-like that is not one: the step goes on, unmeasured
            continue
        if rows > 0 and width > 0:
            return rows * width, rows, rows * width * width
    return None


class StepWindow:
    """Mixin for a framework callback; call :meth:`_setup_window` from its ``__init__``.

    A framework reports a step as two hook calls, not a ``with`` block, so the phase is entered at the
    first and held in an ``ExitStack`` until the second.
    """

    monitor: Monitor | None
    step_phase: str | None

    def _setup_window(self, monitor: Monitor | None, step_phase: str | None, options: dict[str, Any],
                      log_keys: Sequence[str] | None = None, every_n_steps: int = 1,
                      framework: str = "") -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise RankmemError(f"every_n_steps must be >= 1 (optimizer steps between collects), "
                               f"got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self._uncollected = 0  # steps closed since the last collect
        # Read by rankmem advise from the header, which the first collect writes: filled in before it.
        self.framework: dict[str, Any] = {"name": framework}
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
            run_config = {**self._options.get("run_config", {}), "framework": self.framework}
            self.monitor = Monitor(**{**self._options, "run_config": run_config})
        else:
            self.monitor.config.run_config.setdefault("framework", self.framework)
        return self.monitor

    def _step_done(self) -> bool:
        """An optimizer step ended: whether this one collects (every ``every_n_steps``). Every rank
        counts the same steps, so the ranks agree on when to call the collective."""
        self._uncollected += 1
        if self._uncollected < self.every_n_steps:
            return False
        self._uncollected = 0
        return True

    def _note_batches(self, inputs: Any) -> None:
        """Name the batches ``packed`` (several sequences to a row: the flattening collators' ``position_ids``
        or ``cu_seq_lens_q``) or ``padded``, for the units of the advice."""
        if "batches" not in self.framework and isinstance(inputs, Mapping):
            packed = "position_ids" in inputs or "cu_seq_lens_q" in inputs
            self.framework["batches"] = "packed" if packed else "padded"
            if self.monitor is not None:  # its run_config is its own copy, made when it was built
                framework = self.monitor.config.run_config.setdefault("framework", {})
                if isinstance(framework, dict):
                    framework["batches"] = self.framework["batches"]

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
