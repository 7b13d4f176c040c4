"""Hugging Face ``Trainer`` integration: per-rank memory figures, aggregated across ranks, in its logs.

    from rankmem.integrations.hf import RankmemCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[RankmemCallback()])

Each optimizer step is the phase ``train_step``; the window keys cover the steps since the last collect,
gaps included. A collect runs at ``on_step_end`` of every optimizer step (every ``every_n_steps``) and at
``on_train_end``; the Trainer calls both on every process after the same steps, which makes the
collective safe there. ``on_log`` adds the last collect's aggregates to ``logs`` and to the matching
``state.log_history`` entry; an ``evaluate()`` outside training collects at its ``on_log``.

:func:`attach` also wraps ``trainer.training_step`` (once per micro-batch) to read each micro-batch's
work from its inputs' shapes (every position of a 2-D ``input_ids``, else ``attention_mask``, padding
included), for ``rankmem advise``; it puts the callback ahead of the ``report_to`` trackers so they see
the keys; and it wraps ``trainer.train``, so an out-of-memory error becomes an ``oom`` event at its step
and phase, once, also when ``auto_find_batch_size`` retries, and a failure closes the callback's
monitor.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rankmem.core.guard import Guard
from rankmem.errors import MissingExtraError
from rankmem.integrations._window import StepWindow, computed_work
from rankmem.monitor import Monitor

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingExtraError("rankmem.integrations.hf", "hf", "transformers") from exc

__all__ = ["RankmemCallback", "attach"]

STEP_PHASE = "train_step"


class RankmemCallback(StepWindow, TrainerCallback):  # type: ignore[misc]
    """Adds rankmem's cross-rank memory aggregates to the Trainer's logs.

    ``monitor``: a :class:`rankmem.Monitor` you built (on every rank); by default one is built at
    ``on_train_begin`` from ``monitor_options`` (e.g. ``out_dir="runs/x", sinks=("jsonl",)``; default: no
    sinks). ``step_phase``: the phase name for each optimizer step, or ``None``. ``log_keys``: ``fnmatch``
    patterns of the aggregated keys added to the Trainer's logs (default all; the run log keeps them all).
    ``every_n_steps``: optimizer steps between collects (default 1: every step), whatever ``logging_steps``.
    """

    def __init__(self, monitor: Monitor | None = None, *, step_phase: str | None = STEP_PHASE,
                 log_keys: Sequence[str] | None = None, every_n_steps: int = 1, **monitor_options: Any):
        self._setup_window(monitor, step_phase, monitor_options, log_keys, every_n_steps, "hf")
        self.last_metrics: dict[str, float] = {}
        """Every aggregate of the last collect (``log_keys`` aside), on every rank."""
        self._training = False
        self._warned_inputs = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._training = True
        monitor, optimizer = self._monitor(), kwargs.get("optimizer")
        if kwargs.get("model") is not None:  # accelerate's optimizer wrapper steps the torch one it holds
            monitor.track(kwargs["model"], getattr(optimizer, "optimizer", optimizer))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # global_step counts the steps done; this one's collect logs it as global_step + 1.
        self._open_step(int(state.global_step) + 1)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close_step()
        if self._step_done():  # a collective: every process ends the same steps (module docstring)
            self.last_metrics = self._monitor().collect(step=int(state.global_step))

    def _note_inputs(self, inputs: Any) -> None:
        """One micro-batch's inputs, as ``training_step`` receives them: tell its work."""
        if self._step is None or self.monitor is None:
            return
        work = computed_work(inputs)
        if work is None:
            if not self._warned_inputs:
                self._warned_inputs = True
                warnings.warn(f"rankmem: the Trainer's inputs hold no 2-D 'input_ids' or 'attention_mask' "
                              f"(got {type(inputs).__name__}): micro-batch work is not recorded, so rankmem "
                              "advise has no tokens to fit against", stacklevel=3)
            return
        self._note_batches(inputs)
        self.monitor.micro_batch(*work)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not self._training:  # evaluate() alone: every process logs it at the same point (module docstring)
            self.last_metrics = self._monitor().collect(step=int(state.global_step))
        metrics = ranks_as_ints(self._for_logs(self.last_metrics))
        if logs is not None:
            logs.update(metrics)
        # Trainer.log appended a copy of logs to log_history before calling on_log.
        history = getattr(state, "log_history", None)
        if history and history[-1].get("step") == state.global_step:
            history[-1].update(metrics)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close_step()
        self._training = False
        if self._uncollected and self.monitor is not None:  # steps since the last collect (every_n_steps > 1)
            self._uncollected = 0
            self.last_metrics = self.monitor.collect(step=int(state.global_step))
        self._close_monitor()


def ranks_as_ints(metrics: Mapping[str, float]) -> dict[str, float | int]:
    """``.../max_rank`` and ``.../min_rank`` as ints: the Trainer's ``log_history`` (and its JSON) keeps
    what it is given, and a rank reads as ``0``, not ``0.0``."""
    return {k: int(v) if k.endswith("_rank") and math.isfinite(v) and v == int(v) else v for k, v in metrics.items()}


def attach(trainer: Any, callback: RankmemCallback | None = None, **options: Any) -> RankmemCallback:
    """Add ``callback`` (or a new one from ``options``) to ``trainer`` ahead of its tracker callbacks.

    Placed right after the Trainer's flow callback, so every tracker sees the memory keys in the same
    ``logs``. ``trainer.train`` is wrapped so that an out-of-memory error leaving it becomes an ``oom``
    event at its step and phase (the Trainer has no exception hook for a callback).
    """
    cb = callback if callback is not None else RankmemCallback(**options)
    callbacks: list[Any] = trainer.callback_handler.callbacks
    from transformers.trainer_callback import DefaultFlowCallback

    callbacks[:] = [c for c in callbacks if c is not cb]  # already there (callbacks=, attach twice): moved
    flow = [i for i, c in enumerate(callbacks) if isinstance(c, DefaultFlowCallback)]
    callbacks.insert(flow[0] + 1 if flow else 0, cb)
    if not getattr(trainer.train, _RECORDS_FAILURES, False):
        trainer.training_step = _telling_work(trainer)
        trainer.train = _recording_failures(trainer, "train", close=True)
        # An OOM that auto_find_batch_size catches (it halves the batch and retries) never leaves train().
        trainer.training_step = _recording_failures(trainer, "training_step", close=False)
    return cb


_RECORDS_FAILURES = "__rankmem_records_failures__"


def _telling_work(trainer: Any) -> Callable[..., Any]:
    """``trainer.training_step``, but each rankmem callback first notes the micro-batch's lengths.
    Telemetry never stops the step: inputs it cannot read are passed on as they came."""
    wrapped = trainer.training_step

    @functools.wraps(wrapped)
    def telling_work(*args: Any, **kwargs: Any) -> Any:
        inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
        for cb in [c for c in trainer.callback_handler.callbacks if isinstance(c, RankmemCallback)]:
            cb._note_inputs(inputs)
        return wrapped(*args, **kwargs)

    return telling_work


def _recording_failures(trainer: Any, method: str, close: bool) -> Callable[..., Any]:
    """``trainer.<method>``, but an exception leaving it first closes each rankmem callback's open step
    as that exception (an out-of-memory error becomes an ``oom`` event at its step and phase, once:
    the same exception leaving ``training_step`` and then ``train`` is one event) and, with ``close``,
    the monitor the callback built (its heartbeat then says the exit was not clean). The Trainer has no
    exception hook: ``on_train_end`` never runs on a failure."""
    wrapped = getattr(trainer, method)
    # Telemetry must not replace the Trainer's own exception: what it raised is what propagates.
    guard = Guard()
    closing_step = guard.contain("hf-step", f"closing the step after {method}() raised failed")
    closing_monitor = guard.contain("hf-monitor", f"closing the monitor after {method}() raised failed")

    @functools.wraps(wrapped)
    def recording_failures(*args: Any, **kwargs: Any) -> Any:
        try:
            return wrapped(*args, **kwargs)
        except BaseException as exc:  # not a boundary: it records, then re-raises whatever it caught
            for cb in [c for c in trainer.callback_handler.callbacks if isinstance(c, RankmemCallback)]:
                with closing_step:
                    cb._close_step(exc)
                if close:
                    cb._training = False  # a later evaluate() collects at its on_log again
                    with closing_monitor:
                        cb._close_monitor()
            raise

    setattr(recording_failures, _RECORDS_FAILURES, True)
    return recording_failures
