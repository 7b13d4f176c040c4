"""The job options of the reference worker, shared by ``python -m rankmem.engine.train`` and
``rankmem train`` (which forwards them through torchrun). Imports no torch, so the ``rankmem`` CLI
can build its parser without it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from rankmem.errors import RankmemError

TASKS = ("sft", "grpo")
ENGINES = ("ddp", "fsdp")
ATTENTION = ("sdpa", "materialized")
ENGINE_ALIASES = {"fsdp2": "fsdp"}
"""Other names users type for an engine: ``fsdp`` is FSDP2 (``fully_shard``), as README says."""

PACKED_ENV = {"MALLOC_MMAP_THRESHOLD_": "4096", "MALLOC_TRIM_THRESHOLD_": "131072",
              "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}
"""Settings ``rankmem train`` gives the ranks of a token-budget job (unless already set), so that each
window's peak RSS is its own and the resident memory between steps does not creep; docs/advice.md says
why and how to do the same in a job of your own.

- glibc's mmap threshold grows after a large block is freed (up to 32 MiB on 64-bit), after which
  activations come from the heap and stay resident: a small micro-batch after a large one would show the
  large one's peak RSS. Fixed at one page, every block over 4 KiB (a packed micro-batch's per-sequence
  pieces included) is mmap'd and returned on free; what is left on the heap the worker hands back after
  each step (:mod:`rankmem.engine.hostheap`).
- oneDNN (torch's CPU kernels) keeps compiled kernels by tensor shape in its primitive cache, and packed
  micro-batches have new shapes almost every step: RSS between steps grew with the cache on."""

# Options whose default depends on the task (None in the parser until resolve_job_options). GRPO's
# steps are ``make demo``'s: about two minutes on 2 CPU cores, well past the reward's plateau.
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "sft": {"steps": 40, "lr": 3e-3},
    "grpo": {"steps": 400, "lr": 5e-3},
}


def _per_task(dest: str) -> str:
    return ", ".join(f"{defaults[dest]:g} {task}" for task, defaults in TASK_DEFAULTS.items())


# (flag, argparse keyword arguments); help=SUPPRESS marks the hidden fault-injection options.
JOB_OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("--task", dict(choices=TASKS, default="grpo", help="sft: next-token training; grpo: toy RL (default)")),
    ("--engine", dict(choices=(*ENGINES, *ENGINE_ALIASES), default="ddp",
                      help="data-parallel engine: ddp (default), or fsdp (FSDP2's fully_shard; also spelled fsdp2)")),
    ("--steps", dict(type=int, default=None, help=f"optimizer steps (default: {_per_task('steps')})")),
    ("--out", dict(default="runs/train", help="run directory; the run log is OUT/rankmem.jsonl")),
    ("--device", dict(choices=("auto", "cpu", "cuda"), default="auto",
                      help="auto: cuda (NCCL) when available, else cpu (gloo)")),
    ("--seed", dict(type=int, default=0, help="seed of the model init and the generated data")),
    ("--lr", dict(type=float, default=None, help=f"peak learning rate (default: {_per_task('lr')})")),
    ("--batch-size", dict(type=int, default=32, help="sft: sequences per rank per step (default 32)")),
    ("--micro-batch-size", dict(type=int, default=16, help="rows per forward/backward (default 16)")),
    ("--prompts-per-rank", dict(type=int, default=8, help="grpo: prompts per rank per step (default 8)")),
    ("--group-size", dict(type=int, default=8, help="grpo: responses sampled per prompt, >= 2 (default 8)")),
    ("--ppo-max-token-len-per-gpu", dict(type=int, default=None, metavar="TOKENS",
                                         help="grpo: heavy-tailed response lengths packed into micro-batches of about "
                                              "this many tokens per rank (verl's name and meaning: a target the "
                                              "balanced packing may exceed); default: fixed-length rows, "
                                              "--micro-batch-size per micro-batch")),
    ("--log-prob-max-token-len-per-gpu", dict(type=int, default=None, metavar="TOKENS",
                                              help="grpo: the same for the log_prob phase (default: the ppo one)")),
    ("--max-seq-len", dict(type=int, default=256, help="grpo with a token budget: longest sequence (default 256)")),
    ("--attention", dict(choices=ATTENTION, default="sdpa",
                         help="sdpa (default: memory linear in tokens), or materialized (the T x T scores are "
                              "tensors: memory grows with the sum of squared sequence lengths)")),
    ("--peak-tflops", dict(type=float, default=None,
                           help="peak TFLOP/s per device for MFU (default 989 cuda, 0.1 cpu)")),
    ("--pg-timeout-s", dict(type=float, default=120.0, help="process-group collective timeout (default 120 s)")),
    ("--no-progress", dict(action="store_true", help="plain log lines instead of a progress bar")),
    ("--sink", dict(action="append", default=None, metavar="NAME",
                    help="a sink besides the run log, e.g. prometheus or console (repeat for more)")),
    ("--sink-option", dict(action="append", default=None, metavar="NAME.KEY=VALUE",
                           help="an option of a --sink, e.g. prometheus.port=9465 (repeat for more)")),
    ("--fail-at-step", dict(type=int, default=None, help=argparse.SUPPRESS)),
    ("--fail-rank", dict(type=int, default=0, help=argparse.SUPPRESS)),
    ("--stop-at-step", dict(type=int, default=None, help=argparse.SUPPRESS)),
    ("--stop-where", dict(choices=("window", "between"), default="window", help=argparse.SUPPRESS)),
    ("--noise-bytes", dict(type=int, default=0, help=argparse.SUPPRESS)),
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
        elif kwargs.get("action") == "append":
            for item in value or ():
                argv += [flag, str(item)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


# Lower bounds of the integer options (by dest), and why where the bound is not plain.
_AT_LEAST = {"steps": 1, "batch_size": 1, "micro_batch_size": 1, "prompts_per_rank": 1, "group_size": 2,
             "max_seq_len": 16}
_ONLY_FOR = {"group_size": "grpo"}
"""Bounds that hold for one task only: SFT ignores the group size, so ``--group-size 1`` is no error there."""
_WHY = {"group_size": ": GRPO's advantage is a response's reward against its group's mean and standard "
                      "deviation, which one response per prompt does not have"}
_POSITIVE = ("lr", "peak_tflops")
# The process-group timeout: below a second every collective (and the rendezvous itself) times out;
# above a year timedelta and the backends' millisecond counters overflow long before it matters.
PG_TIMEOUT_RANGE_S = (1.0, 365 * 86400.0)
SEED_MAX = 2**32 - 1  # the data generator seeds with seed * 1_000_003 + ...: it must stay in int64
STEPS_MAX = 10**9
ROW_BYTES = 1 << 20
"""What one sequence of a batch may cost a rank at most (the tiny GPT's activations and autograd graph for
32 tokens are ~0.5 MiB): a batch of more rows than the node's available memory holds cannot run."""


def available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The node's MemAvailable, None where unknown (not Linux)."""
    try:
        with open(meminfo, "rb") as f:
            for line in f.read(1 << 16).splitlines():
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_upper_bounds(args: argparse.Namespace) -> None:
    """Every size an option gives is bounded by what the node can hold, before anything is allocated."""
    if args.steps > STEPS_MAX:
        raise RankmemError(f"--steps must be at most {STEPS_MAX:,}, got {args.steps}")
    available = available_bytes()
    max_rows = max(1, available // ROW_BYTES) if available is not None else 1 << 20
    rows = {"batch_size": args.batch_size, "micro_batch_size": args.micro_batch_size,
            "prompts_per_rank": args.prompts_per_rank,
            "group_size": args.group_size if args.task == "grpo" else 1}
    if args.task == "grpo":
        rows["prompts_per_rank"] = args.prompts_per_rank * args.group_size
    for dest, count in rows.items():
        if count > max_rows:
            grpo = dest == "prompts_per_rank" and args.task == "grpo"
            flag = "--prompts-per-rank x --group-size" if grpo else _flag(dest)
            raise RankmemError(f"{flag} asks for {count:,} sequences per rank, more than this node's "
                               f"{(available or 0) >> 20:,} MiB available can hold (at most {max_rows:,})")
    if args.fail_at_step is not None and not -(2**63) <= args.fail_at_step < 2**63:
        raise RankmemError(f"--fail-at-step must be a 64-bit step, got {args.fail_at_step}")


def resolve_job_options(args: argparse.Namespace) -> None:
    """Fill in the task's defaults and check every job option, in place; a bad one raises RankmemError
    naming the flag. ``rankmem train`` calls it before launching and the entry script before joining the
    process group, so a bad option is one line, not a traceback from every rank (or a NaN run)."""
    for dest, value in TASK_DEFAULTS[args.task].items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    args.engine = ENGINE_ALIASES.get(args.engine, args.engine)
    for dest, minimum in _AT_LEAST.items():
        if _ONLY_FOR.get(dest, args.task) != args.task:
            continue
        if getattr(args, dest) < minimum:
            raise RankmemError(f"{_flag(dest)} must be >= {minimum}, got {getattr(args, dest)}{_WHY.get(dest, '')}")
    for dest in _POSITIVE:
        value = getattr(args, dest)
        if value is not None and not 0 < value < math.inf:  # `not` also refuses NaN
            raise RankmemError(f"{_flag(dest)} must be a finite number > 0, got {value}")
    low, high = PG_TIMEOUT_RANGE_S
    if not low <= args.pg_timeout_s <= high:
        raise RankmemError(f"--pg-timeout-s must be a number of seconds in {low:.0f}..{high:.0f} (a year), "
                           f"got {args.pg_timeout_s}")
    if not 0 <= args.seed <= SEED_MAX:
        raise RankmemError(f"--seed must be in 0..{SEED_MAX}, got {args.seed}")
    _check_upper_bounds(args)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise RankmemError(f"--out {args.out} is a file: it names the run directory (the run log is OUT/rankmem.jsonl)")
    sink_options(args)
    for dest in ("ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu"):
        value = getattr(args, dest)
        if value is not None and value < args.max_seq_len:
            raise RankmemError(f"{_flag(dest)} must be >= --max-seq-len ({args.max_seq_len}): every micro-batch "
                               f"must hold the longest sequence, got {value}")
    if args.log_prob_max_token_len_per_gpu is not None and args.ppo_max_token_len_per_gpu is None:
        raise RankmemError("--log-prob-max-token-len-per-gpu needs --ppo-max-token-len-per-gpu (the packed mode)")
    if args.log_prob_max_token_len_per_gpu is None:
        args.log_prob_max_token_len_per_gpu = args.ppo_max_token_len_per_gpu
    if not 0 <= args.noise_bytes <= 1 << 20:
        raise RankmemError(f"--noise-bytes must be in 0..{1 << 20}, got {args.noise_bytes}")
    if args.fail_at_step is not None and args.fail_rank < 0:
        raise RankmemError(f"--fail-rank must be >= 0, got {args.fail_rank}")


def sink_options(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """``--sink-option NAME.KEY=VALUE`` as the Monitor's ``sink_options``, checked against ``--sink``
    and the sinks' own options. A value reads as JSON where it is JSON (``9465``, ``true``), else as text."""
    from rankmem.sinks import check_sink_specs, make_sink

    sinks = list(args.sink or ())
    options: dict[str, dict[str, Any]] = {}
    for item in args.sink_option or ():
        name, dot, rest = item.partition(".")
        key, eq, text = rest.partition("=")
        if not (dot and eq and name and key):
            raise RankmemError(f"--sink-option {item!r}: write NAME.KEY=VALUE, e.g. prometheus.port=9465")
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        options.setdefault(name, {})[key] = value
    try:
        check_sink_specs(["jsonl", *sinks], args.out, options)
        for name, given in options.items():
            make_sink(name, args.out, **given)  # a constructor checks its values and opens nothing
    except RankmemError as exc:
        raise RankmemError(f"--sink/--sink-option: {exc}") from None
    return options


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")
