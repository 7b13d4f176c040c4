"""The ``wandb`` sink: the aggregated keys in a W&B run.

If the process already has an active W&B run (the trainer's own), rankmem logs into it against its
own ``rankmem/step`` axis and leaves it open. Otherwise it starts a run under ``<out_dir>`` with
``mode`` from the argument, else ``WANDB_MODE``, else ``"offline"``: turning on memory telemetry
should never start an upload or a login prompt. Upload an offline run later with ``wandb sync``.
"""

from __future__ import annotations

import math
import os
from typing import Any

from rankmem.core.catalogue import MEMORY_PREFIX
from rankmem.core.records import RunHeader, StepRecord

_STEP_KEY = "rankmem/step"


class WandbSink:
    """Logs every finite aggregated key per step; ``wandb.init`` options pass through ``init``."""

    def __init__(
        self,
        out_dir: str | None = None,
        project: str = "rankmem",
        mode: str | None = None,
        name: str | None = None,
        init: dict[str, Any] | None = None,
    ) -> None:
        self.out_dir = out_dir
        self.project = project
        self.mode = mode or os.environ.get("WANDB_MODE") or "offline"
        self.name = name or (os.path.basename(os.path.abspath(out_dir)) if out_dir else None)
        self._init = dict(init or {})
        self._run: Any = None
        self._owned = False

    def open(self, header: RunHeader) -> None:
        import wandb

        config = {"rankmem": {"world_size": header.world_size, "hosts": sorted({r.host for r in header.ranks})}}
        if wandb.run is not None:
            self._run, self._owned = wandb.run, False
            self._run.config.update(config, allow_val_change=True)
            # The trainer owns the run's step counter; our keys get their own x-axis.
            self._run.define_metric(_STEP_KEY)
            self._run.define_metric(MEMORY_PREFIX + "*", step_metric=_STEP_KEY)
            return
        if self.out_dir is not None:
            os.makedirs(self.out_dir, exist_ok=True)
        kwargs: dict[str, Any] = {"project": self.project, "mode": self.mode, "name": self.name, "config": config}
        if self.out_dir is not None:
            kwargs["dir"] = self.out_dir
        kwargs.update(self._init)
        self._run, self._owned = wandb.init(**kwargs), True

    def write(self, record: StepRecord) -> None:
        data: dict[str, float] = {k: v for k, v in record.metrics.items() if math.isfinite(v)}
        if self._owned:
            self._run.log(data, step=record.step)
        else:
            # commit=False: ride along with the trainer's next log instead of advancing its step.
            data[_STEP_KEY] = record.step
            self._run.log(data, commit=False)

    def close(self) -> None:
        if self._run is not None and self._owned:
            self._run.finish()
        self._run = None
