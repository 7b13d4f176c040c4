"""Lightning integration: per-rank memory figures, aggregated across ranks, through Lightning's loggers.

    from rankmem.integrations.lightning import RankmemCallback
    trainer = L.Trainer(callbacks=[RankmemCallback()], ...)

Each training batch (``on_train_batch_start`` .. ``on_train_batch_end``) is the phase ``train_step``;
the window keys cover the whole interval between logs. Every ``every_n_steps`` batches (default:
the Trainer's ``log_every_n_steps``) every rank calls :meth:`rankmem.Monitor.collect`, a collective:
the hooks run on every rank and DDP ranks run the same number of batches (the distributed sampler
pads), so the ranks agree on when. Every rank holds the same aggregates; on Lightning's own logging
steps (``every_n_steps`` left at ``log_every_n_steps``) they are logged with ``log_dict`` per step,
unreduced (``on_epoch=False``, ``sync_dist=False``: never reduced again), so they leave in the same
``log_metrics`` call as the batch's ``self.log`` values: the loss and the memory on one CSV row. On
other steps the global-zero rank writes them to every logger with ``log_metrics``, at the step
number Lightning's own logging uses for that batch; the run log uses it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rankmem.errors import MissingExtraError, RankmemError
from rankmem.integrations._window import StepWindow
from rankmem.monitor import Monitor

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingExtraError("rankmem.integrations.lightning", "lightning", "lightning") from exc

__all__ = ["RankmemCallback"]

STEP_PHASE = "train_step"


def logging_step(trainer: Any) -> int:
    """The step Lightning logs this batch's ``self.log`` values at: its fit loop's count of batches that
    stepped the optimizer, not yet advanced for this batch (``global_step`` already is, one ahead).
    Lightning keeps that count private; where it is missing, ``global_step``."""
    count = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "_batches_that_stepped", None)
    return int(count) if isinstance(count, int) else int(trainer.global_step)


class RankmemCallback(StepWindow, Callback):  # type: ignore[misc]
    """Logs rankmem's cross-rank memory aggregates through the Trainer's loggers.

    ``monitor``: a :class:`rankmem.Monitor` you built on every rank; by default one is built at
    ``setup``, after the strategy has initialised the process group, from ``monitor_options``
    (default: no sinks). ``every_n_steps``: batches between collects (default: the Trainer's
    ``log_every_n_steps``; with ``accumulate_grad_batches > 1`` that counts batches, not the optimizer
    steps Lightning's own logging counts, so pass ``every_n_steps`` to line the two up). ``step_phase``: the phase name per batch, or ``None`` to skip it.
    ``log_keys``: ``fnmatch`` patterns of the aggregated keys sent to the loggers (default all; the run
    log keeps them all).
    """

    def __init__(
        self,
        monitor: Monitor | None = None,
        *,
        every_n_steps: int | None = None,
        step_phase: str | None = STEP_PHASE,
        log_keys: Sequence[str] | None = None,
        **monitor_options: Any,
    ) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise RankmemError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self._setup_window(monitor, step_phase, monitor_options, log_keys)
        self.every_n_steps = every_n_steps
        self._batches = 0
        self.last_metrics: dict[str, float] = {}
        """The aggregates of the last collect, on every rank."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._monitor()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        for optimizer in trainer.optimizers or [None]:  # created after setup(): tracked here
            self._monitor().track(pl_module, optimizer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._open_step(logging_step(trainer))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._close_step()
        self._batches += 1
        every = self.every_n_steps or int(getattr(trainer, "log_every_n_steps", 50) or 50)
        if self._batches % every == 0:
            self._collect(trainer, pl_module)

    def _collect(self, trainer: Any, pl_module: Any) -> None:
        step = logging_step(trainer)
        self.last_metrics = self._monitor().collect(step=step)  # a collective: every rank is here (docstring)
        if self._with_lightnings_own(trainer):
            # Every rank holds the same aggregates: logged per step, unreduced, they join this batch's
            # self.log values (the loss) in Lightning's one log_metrics call: one CSV row, not two.
            pl_module.log_dict(self._for_logs(self.last_metrics), on_step=True, on_epoch=False, sync_dist=False,
                               batch_size=1)
        elif trainer.is_global_zero:
            metrics = self._for_logs(self.last_metrics)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _with_lightnings_own(self, trainer: Any) -> bool:
        """Whether this collect is on a step Lightning logs its own values at (the collect cadence is its
        ``log_every_n_steps``); then the memory keys go with them, else straight to the loggers."""
        every = self.every_n_steps
        return every is None or every == int(getattr(trainer, "log_every_n_steps", 0) or 0)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # An OOM in the step's forward/backward reaches here, not on_train_batch_end: record it.
        self._close_step(exception)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close_step()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close_monitor()
