"""The reference job: a tiny GPT trained by :class:`TrainingWorker` with per-rank memory telemetry.

Run (one node, two ranks)::

    python -m torch.distributed.run --nproc-per-node 2 -m rankmem.engine.train --task grpo --out runs/demo

Several nodes: the same line on each node with ``--nnodes N --node-rank I --rdzv-backend c10d
--rdzv-endpoint HOST:PORT``. ``rankmem train`` builds these lines for you.

Every rank measures; the logging rank (0) writes ``OUT/rankmem.jsonl``, shows progress and prints a
summary: the peak of each memory key with its step, rank and phase.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import shlex
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from rankmem.core.catalogue import SUMMARY_KEYS, key_of, phase_of_peak, worst_stat
from rankmem.core.rundir import RunDir
from rankmem.engine.options import add_job_arguments, resolve_job_options, sink_options
from rankmem.engine.output import say
from rankmem.engine.progress import Progress
from rankmem.engine.tasks import build_model, task_steps, worker_config
from rankmem.engine.worker import TrainingWorker
from rankmem.errors import RankmemError
from rankmem.monitor import Monitor

StepCallback = Callable[[int, Mapping[str, float]], None]


def init_distributed(device_choice: str, timeout_s: float) -> torch.device:
    """Join the torchrun job: NCCL on GPU, gloo on CPU, always with a timeout (a lost rank is an error,
    not a hang)."""
    if "RANK" not in os.environ:
        raise RankmemError("launch under torchrun: python -m torch.distributed.run --nproc-per-node 2 -m "
                           "rankmem.engine.train")
    use_cuda = torch.cuda.is_available() if device_choice == "auto" else device_choice == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RankmemError("--device cuda, but this torch has no CUDA device: use --device cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device


def run_task(worker: TrainingWorker, args: argparse.Namespace, on_step: StepCallback) -> None:
    steps = task_steps(worker, args)  # the step bodies live in engine.tasks, shared with the Ray launcher
    for step in range(args.steps):
        on_step(step, steps.step(step))


# ---- the logging rank's view: progress and summary ----------------------------------------------------
# The summary names the run's worst value of the catalogue's SUMMARY_KEYS at the catalogue's worse end
# (the max, or the min where low is bad); the phase comes from the rule `rankmem report` uses
# (catalogue.peak_phase: the phase memory rose in, or a verdict naming none).


@dataclass
class Peak:
    value: float
    step: int
    rank: int
    phase: str
    stat: str = "max"
    """``max`` or ``min``: the worse end of the key, whose ``K/<stat>_rank`` named the rank."""


class PeakTracker:
    """The worst value of each summary key over the run (the max, or the min where low is bad), with
    its step, rank and phase."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.peaks: dict[str, Peak] = {}

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        for key in SUMMARY_KEYS:
            stat = worst_stat(key)
            value = metrics.get(f"{key}/{stat}")
            rank = metrics.get(f"{key}/{stat}_rank")
            if value is None or rank is None or not math.isfinite(value) or rank < 0:
                continue
            held = self.peaks.get(key)
            if held is not None and (held.value <= value if stat == "min" else held.value >= value):
                continue
            record = self.monitor.last_record  # built on first use: only on a new worst, not every step
            rank_values = {k: v[int(rank)] for k, v in record.ranks.items()} if record is not None else {}
            self.peaks[key] = Peak(value, step, int(rank), phase_of_peak(key, value, rank_values) or "-", stat)

    def lines(self) -> list[str]:
        out = []
        for key, p in self.peaks.items():
            if p.stat == "max" and p.value < NOTHING_GIB:  # e.g. no dataloader workers: zeros say nothing
                continue
            # A verdict that names no single phase ("(held from before: ...)", "(tie: ...)") stands alone.
            phase = p.phase if p.phase.startswith("(") else f"phase {p.phase}"
            out.append(f"  {key:<32} {p.stat} {p.value:8.3f} GiB  rank {p.rank}  step {p.step}  {phase}")
        return out


NOTHING_GIB = 0.0005
"""A summary row below this prints as 0.000 GiB: it is left out."""


# GRPO's loss is the PPO-clip policy loss: on-policy with group-normalised advantages it is ~0 by
# construction (a few 1e-9 at first), so it is printed with an exponent, not as a "-0.000" that looks
# broken. Each task's scalars: (key, label, format); no KL term is computed, so none is shown.
SCALARS = {
    "grpo": (("reward", "reward", ".3f"), ("loss", "pg_loss", "+.3e")),
    "sft": (("loss", "loss", ".3f"),),
}


class Trajectory:
    """First and last value (mean over ranks) of the scalars a user of the task reads, for the summary."""

    def __init__(self, task: str) -> None:
        self.scalars = SCALARS[task]
        self.first: dict[str, tuple[int, float]] = {}
        self.last: dict[str, tuple[int, float]] = {}

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, _, _ in self.scalars:
            value = metrics.get(key + "/mean")
            if value is not None:
                self.first.setdefault(key, (step, value))
                self.last[key] = (step, value)

    def lines(self) -> list[str]:
        out = []
        for key, label, fmt in self.scalars:
            if key in self.first:
                (s0, v0), (s1, v1) = self.first[key], self.last[key]
                out.append(f"{label} (mean over ranks): {v0:{fmt}} at step {s0} -> {v1:{fmt}} at step {s1}")
        return out


def headline(metrics: Mapping[str, float], task: str) -> str:
    parts = [f"{label} {metrics[key + '/mean']:{fmt}}" for key, label, fmt in SCALARS[task] if key + "/mean" in metrics]
    for key, label in ((key_of("peak_reserved"), "dev peak"), (key_of("peak_rss"), "rss peak")):
        if key + "/max" in metrics:
            parts.append(f"{label} {metrics[key + '/max']:.2f} GiB (rank {int(metrics[key + '/max_rank'])})")
    return " | ".join(parts)


def train(args: argparse.Namespace, device: torch.device) -> None:
    """Build the model, worker and monitor, run the task, and on the logging rank print the summary.
    ``args`` as :func:`resolve_job_options` leaves them (task defaults filled in)."""
    model = build_model(args)
    config = worker_config(args)
    run_config = {**vars(args), "params": model.num_params(), "worker": asdict(config)}
    monitor = Monitor(out_dir=args.out, sinks=("jsonl", *(args.sink or ())), sink_options=sink_options(args),
                      run_config=run_config)
    try:
        worker = TrainingWorker(model, config, device=device, monitor=monitor)
        torch.manual_seed(args.seed * 1000 + worker.rank + 1)  # different sampling per rank, same init
        tracker = PeakTracker(monitor)
        trajectory = Trajectory(args.task)
        logging_rank = monitor.is_logging_rank
        if logging_rank:
            say(f"rankmem train: live view: rankmem watch {shlex.quote(args.out)}  (in another terminal)")
        with Progress(logging_rank, args.steps, args.task, bar=not args.no_progress) as progress:

            def on_step(step: int, metrics: Mapping[str, float]) -> None:
                if logging_rank:
                    tracker.update(step, metrics)
                    trajectory.update(step, metrics)
                    progress.advance(step, headline(metrics, args.task))

            run_task(worker, args, on_step)
    finally:
        monitor.close()  # every line written so far is already flushed
    if logging_rank:
        say(f"rankmem train: {args.task}/{args.engine}, {worker.world_size} ranks, {args.steps} steps, "
            f"{model.num_params() / 1e6:.2f}M params, device {device.type}")
        say("\n".join(trajectory.lines()))
        say("worst memory over ranks and steps (max; min where low is bad):")
        say("\n".join(tracker.lines()))
        say(f"run log: {RunDir(args.out).log}")
        say("\n".join(next_steps(args.out)))


def next_steps(out: str) -> list[str]:
    """What to run after the job: the offline tools on its run directory."""
    q = shlex.quote(out)
    return ["next:",
            f"  rankmem report {q}   # per key and phase: the worst rank, step and phase; leaks (--html FILE: a page)",
            f"  rankmem plot {q}     # per-rank memory against step, capacity drawn: "
            f"{os.path.join(out, 'rankmem.png')}",
            f"  rankmem watch {q}    # a live per-rank view, while a job writes there"]


@record  # torchrun's agent then shows the failing rank's traceback as the root cause
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_job_arguments(parser)
    args = parser.parse_args(argv)
    try:
        resolve_job_options(args)
    except RankmemError as exc:
        parser.error(str(exc))  # exit 2 with the one line, before any rank joins the group
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    device = init_distributed(args.device, args.pg_timeout_s)
    try:
        train(args, device)
        dist.barrier()  # leave together: no collective is in flight when the group goes
    finally:
        # FSDP2's DTensors and device mesh hold the process group; free them while the interpreter is
        # whole, or gloo's threads can be torn down during interpreter exit (SIGABRT; pytorch#179291).
        gc.collect()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
