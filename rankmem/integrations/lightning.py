"""Lightning integration: per-rank memory figures, aggregated across ranks, through Lightning's loggers.

    from rankmem.integrations.lightning import RankmemCallback
    trainer = L.Trainer(callbacks=[RankmemCallback()], ...)

Each training batch is the phase ``train_step``; the window keys cover the whole interval between
collects. After every optimizer step (every ``every_n_steps``) every rank calls
:meth:`rankmem.Monitor.collect`, a collective: the hooks run on every rank on the same batches. On
Lightning's logging steps the aggregates are also logged with ``log_dict`` (unreduced: every rank holds
the same), in the same ``log_metrics`` call as the batch's own values.

Work: each batch is a micro-batch; its work is every position of a 2-D ``input_ids`` (else
``attention_mask``) of a mapping batch, padding included, or what ``tokens_from(batch)`` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rankmem.errors import MissingExtraError
from rankmem.integrations._window import StepWindow, computed_work
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

    ``monitor``: a :class:`rankmem.Monitor` you built on every rank; by default one is built at ``setup``
    from ``monitor_options`` (default: no sinks). ``every_n_steps``: optimizer steps between collects
    (default 1). ``step_phase``: the phase name per batch, or ``None``. ``log_keys``: ``fnmatch`` patterns
    of the aggregated keys sent to the loggers (default all). ``tokens_from``: ``batch -> tokens`` or
    ``(tokens, sequences, sq_tokens)``, where the batch is no mapping with ``input_ids``/``attention_mask``.
    """

    def __init__(
        self,
        monitor: Monitor | None = None,
        *,
        every_n_steps: int = 1,
        step_phase: str | None = STEP_PHASE,
        log_keys: Sequence[str] | None = None,
        tokens_from: Callable[[Any], Any] | None = None,
        **monitor_options: Any,
    ) -> None:
        self._setup_window(monitor, step_phase, monitor_options, log_keys, every_n_steps, "lightning")
        self.tokens_from = tokens_from
        self._stepped_before = 0
        self.last_metrics: dict[str, float] = {}
        """The aggregates of the last collect, on every rank."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._monitor()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        for optimizer in trainer.optimizers or [None]:  # created after setup(): tracked here
            self._monitor().track(pl_module, optimizer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._stepped_before = int(trainer.global_step)
        self._open_step(logging_step(trainer))
        work = computed_work(batch) if self.tokens_from is None else self.tokens_from(batch)
        if work is not None and self.monitor is not None and self._step is not None:
            if self.tokens_from is None:
                self._note_batches(batch)
            self.monitor.micro_batch(*(work if isinstance(work, tuple) else (work,)))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._close_step()
        # global_step counts optimizer steps: a batch that only accumulated gradients does not collect.
        if int(trainer.global_step) > self._stepped_before and self._step_done():
            self._collect(trainer, pl_module)

    def _collect(self, trainer: Any, pl_module: Any) -> None:
        self.last_metrics = self._monitor().collect(step=logging_step(trainer))  # a collective (docstring)
        connector = getattr(trainer, "_logger_connector", None)
        if getattr(connector, "should_update_logs", True):
            # Every rank holds the same aggregates: logged per step, unreduced, they join this batch's
            # self.log values (the loss) in Lightning's one log_metrics call: one CSV row, not two.
            pl_module.log_dict(self._for_logs(self.last_metrics), on_step=True, on_epoch=False, sync_dist=False,
                               batch_size=1)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # An OOM in the step's forward/backward reaches here, not on_train_batch_end: record it.
        self._close_step(exception)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close_step()
        if self._uncollected and self.monitor is not None:  # steps since the last collect: the run log's
            self._uncollected = 0
            self.last_metrics = self.monitor.collect()  # at the last batch's step, which set_step named

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close_monitor()
