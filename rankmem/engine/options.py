"""The job options of the reference worker, shared by ``python -m rankmem.engine.train`` and
``rankmem train`` (which forwards them through torchrun). Imports no torch, so the ``rankmem`` CLI
can build its parser without it.
"""

from __future__ import annotations

import argparse
from typing import Any

TASKS = ("sft", "grpo")
ENGINES = ("ddp", "fsdp")

# (flag, argparse keyword arguments); help=SUPPRESS marks the hidden fault-injection options.
JOB_OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("--task", dict(choices=TASKS, default="grpo", help="sft: next-token training; grpo: toy RL (default)")),
    ("--engine", dict(choices=ENGINES, default="ddp", help="data-parallel engine (default ddp)")),
    ("--steps", dict(type=int, default=40, help="optimizer steps (default 40)")),
    ("--out", dict(default="runs/train", help="run directory; the run log is OUT/rankmem.jsonl")),
    ("--device", dict(choices=("auto", "cpu", "cuda"), default="auto",
                      help="auto: cuda (NCCL) when available, else cpu (gloo)")),
    ("--seed", dict(type=int, default=0, help="seed of the model init and the generated data")),
    ("--lr", dict(type=float, default=None, help="peak learning rate (default: 3e-3 sft, 5e-3 grpo)")),
    ("--batch-size", dict(type=int, default=32, help="sft: sequences per rank per step (default 32)")),
    ("--micro-batch-size", dict(type=int, default=16, help="rows per forward/backward (default 16)")),
    ("--prompts-per-rank", dict(type=int, default=8, help="grpo: prompts per rank per step (default 8)")),
    ("--group-size", dict(type=int, default=8, help="grpo: responses sampled per prompt (default 8)")),
    ("--peak-tflops", dict(type=float, default=None, help="peak TFLOP/s per device for MFU (default 989 cuda, 0.1 cpu)")),
    ("--pg-timeout-s", dict(type=float, default=120.0, help="process-group collective timeout (default 120 s)")),
    ("--no-progress", dict(action="store_true", help="plain log lines instead of a progress bar")),
    ("--fail-at-step", dict(type=int, default=None, help=argparse.SUPPRESS)),
    ("--fail-rank", dict(type=int, default=0, help=argparse.SUPPRESS)),
]


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, kwargs in JOB_OPTIONS:
        parser.add_argument(flag, **kwargs)


def job_argv(args: argparse.Namespace) -> list[str]:
    """The job options of ``args`` as command-line arguments for the torchrun entry script."""
    argv: list[str] = []
    for flag, kwargs in JOB_OPTIONS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if kwargs.get("action") == "store_true":
            if value:
                argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    return argv
