"""The reference worker as one Ray actor per rank, driven step by step by the driver.

The driver (:mod:`rankmem.ray.launcher`) calls, on every rank: :meth:`EngineActor.join` (from
:class:`~rankmem.ray.rank.RankActor`), :meth:`EngineActor.build`, then :meth:`EngineActor.step` once
per step, and at the end :meth:`EngineActor.finish`. A step runs the same
:meth:`~rankmem.engine.tasks.TaskSteps.step` as under torchrun and returns its gathered metrics,
like verl's ``train_batch``: every rank returns the same cross-rank aggregate (``K/max``,
``K/max_rank``, ...), so the driver can keep any one rank's output, as verl keeps ``data[0]``, and
still see the worst rank.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict
from typing import Any

import torch

from rankmem.engine.model import GPT, GPTConfig
from rankmem.engine.options import sink_options
from rankmem.engine.tasks import TaskSteps, task_steps, vocab_size
from rankmem.engine.train import PeakTracker
from rankmem.engine.worker import TrainingWorker, WorkerConfig
from rankmem.integrations.ray import actor_monitor
from rankmem.monitor import Monitor
from rankmem.ray.rank import RankActor


class EngineActor(RankActor):
    """One rank of the reference job. ``job``: the job options as
    :func:`rankmem.engine.options.resolve_job_options` leaves them (``out`` absolute)."""

    monitor: Monitor
    worker: TrainingWorker
    steps: TaskSteps

    def build(self, job: argparse.Namespace, launch: dict[str, Any]) -> dict[str, Any]:
        """Build the model, the worker and its Monitor (after :meth:`join`). ``launch`` (how the driver
        launched the job) goes into the run log header with the job options."""
        self.job = job
        torch.manual_seed(job.seed)  # the same initial weights on every rank
        model = GPT(GPTConfig(vocab_size=vocab_size(job.task)))
        config = WorkerConfig(engine=job.engine, lr=job.lr, total_steps=job.steps,
                              micro_batch_size=job.micro_batch_size, peak_tflops=job.peak_tflops)
        run_config = {**vars(job), "params": model.num_params(), "worker": asdict(config), "launch": launch}
        self.monitor = actor_monitor(out_dir=job.out, sinks=("jsonl", *(job.sink or ())),
                                     sink_options=sink_options(job), run_config=run_config)
        self.worker = TrainingWorker(model, config, device=self.device, monitor=self.monitor)
        torch.manual_seed(job.seed * 1000 + self.rank + 1)  # different sampling per rank, same init
        self.steps = task_steps(self.worker, job)
        self.tracker = PeakTracker(self.monitor) if self.monitor.is_logging_rank else None
        return {"params": model.num_params(), "device": self.device.type, "pid": os.getpid()}

    def step(self, n: int) -> dict[str, float]:
        """Step ``n`` on this rank (a collective); returns the metrics gathered over every rank."""
        metrics = self.steps.step(n)
        if self.tracker is not None:
            self.tracker.update(n, metrics)
        return metrics

    def local_figures(self) -> dict[str, float]:
        """This rank's own values from the last step's record: what a driver keeping one rank's
        *unaggregated* figures (verl's ``perf/*`` memory keys before rankmem) would see."""
        record = self.monitor.last_record
        if record is None:
            return {}
        out = {}
        for key, values in record.ranks.items():
            value = values[self.rank]
            if value is not None:
                out[key] = value
        return out

    def summary(self) -> list[str]:
        """The logging rank's peak lines (max over ranks and steps, with rank, step and phase)."""
        return self.tracker.lines() if self.tracker is not None else []

    def finish(self) -> None:
        """Close the Monitor and leave the group together (a collective)."""
        self.monitor.close()
        self.leave()
