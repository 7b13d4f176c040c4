"""One optimizer step of each reference task, shared by every launcher.

Under torchrun each rank loops over the steps itself (:func:`rankmem.engine.train.run_task`); under
Ray the driver calls an actor's step method once per step (:mod:`rankmem.ray.actor`). Both run the
same :meth:`TaskSteps.step`, so the two launches train the same model on the same data.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Protocol

import torch

from rankmem.engine.data import ArithmeticSFT, CountingTask, extend_counting, group_normalised_advantages
from rankmem.engine.model import GPT, GPTConfig
from rankmem.engine.worker import TrainingWorker, WorkerConfig, make_pg_loss, sft_loss

# Sizes of the generated tasks: small vocabularies keep the tiny GPT's learning visible in a few steps.
SFT_VOCAB, SFT_SEQ_LEN = 32, 24
GRPO_VOCAB, PROMPT_LEN, RESPONSE_LEN = 16, 4, 6


class TaskSteps(Protocol):
    def step(self, step: int) -> dict[str, float]:
        """Run step ``step`` inside the monitor's step window and return the gathered metrics. A
        collective: every rank calls it with the same ``step``."""
        ...


def vocab_size(task: str) -> int:
    return SFT_VOCAB if task == "sft" else GRPO_VOCAB


def packed(args: argparse.Namespace) -> bool:
    """GRPO with a token budget: heavy-tailed lengths packed into token-budget micro-batches."""
    return args.task == "grpo" and args.ppo_max_token_len_per_gpu is not None


def build_model(args: argparse.Namespace) -> GPT:
    """The job's GPT: its position table covers ``--max-seq-len`` in the packed mode."""
    block = args.max_seq_len if packed(args) else GPTConfig.block_size
    return GPT(GPTConfig(vocab_size=vocab_size(args.task), block_size=block, attention=args.attention))


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(engine=args.engine, lr=args.lr, total_steps=args.steps, micro_batch_size=args.micro_batch_size,
                        peak_tflops=args.peak_tflops, max_token_len=args.ppo_max_token_len_per_gpu,
                        log_prob_max_token_len=args.log_prob_max_token_len_per_gpu,
                        release_heap=packed(args))


class SFTSteps:
    """Next-token training on generated arithmetic sequences."""

    def __init__(self, worker: TrainingWorker, args: argparse.Namespace) -> None:
        self.worker, self.args = worker, args
        self.data = ArithmeticSFT(SFT_VOCAB, SFT_SEQ_LEN, args.batch_size, seed=args.seed)

    def step(self, step: int) -> dict[str, float]:
        worker = self.worker
        batch = self.data.batch(worker.rank, step)
        with worker.step(step):
            maybe_stop(self.args, step, worker.rank, "window")
            maybe_fail(self.args, step, worker.rank)
            out = worker.train_batch(batch, sft_loss)
        maybe_stop(self.args, step, worker.rank, "between")
        noise(self.args, step)
        return worker.finish_step(out)


class GRPOSteps:
    """Toy RL: rollout, log-probs of the rollout, then a PPO-clip update, each its own telemetry phase."""

    def __init__(self, worker: TrainingWorker, args: argparse.Namespace) -> None:
        self.worker, self.args = worker, args
        self.task = CountingTask(GRPO_VOCAB, PROMPT_LEN, RESPONSE_LEN, args.prompts_per_rank, args.group_size,
                                 seed=args.seed)
        self.pg_loss = make_pg_loss()

    def step(self, step: int) -> dict[str, float]:
        worker, task, args = self.worker, self.task, self.args
        prompts = task.prompts(worker.rank, step)
        mask = task.response_mask(prompts.shape[0])
        with worker.step(step):
            with worker.phase("rollout"):
                seqs = worker.generate(prompts, RESPONSE_LEN)
                rewards = task.reward(prompts, seqs[:, PROMPT_LEN:])
                advantages = group_normalised_advantages(rewards, args.group_size)
                extra = self._lengthen(seqs, worker.rank, step) if packed(args) else {}
                if extra:
                    seqs, mask = extra["input_ids"], extra["loss_mask"]
            with worker.phase("log_prob"):
                old = worker.infer_batch({"input_ids": seqs, "loss_mask": mask, **extra}).log_probs
            maybe_fail(args, step, worker.rank)
            with worker.phase("update"):
                batch = {"input_ids": seqs, "loss_mask": mask, "old_log_probs": old, "advantages": advantages,
                         **({"lengths": extra["lengths"]} if extra else {})}
                out = worker.train_batch(batch, self.pg_loss)
        return worker.finish_step(out, {"reward": rewards.mean()})


    def _lengthen(self, seqs: torch.Tensor, rank: int, step: int) -> dict[str, torch.Tensor]:
        """The packed mode's long-tailed responses: lengths, the rows continued to them, their loss mask."""
        lengths = self.task.lengths(rank, step, seqs.shape[1], self.args.max_seq_len)
        ids = extend_counting(seqs, lengths, GRPO_VOCAB)
        positions = torch.arange(ids.shape[1] - 1)
        mask = ((positions >= PROMPT_LEN - 1) & (positions < lengths[:, None] - 1)).float()
        return {"input_ids": ids, "loss_mask": mask, "lengths": lengths}


def task_steps(worker: TrainingWorker, args: argparse.Namespace) -> TaskSteps:
    """The steps of ``args.task`` (``args`` as :func:`rankmem.engine.options.resolve_job_options` leaves them)."""
    return SFTSteps(worker, args) if args.task == "sft" else GRPOSteps(worker, args)


def maybe_stop(args: argparse.Namespace, step: int, rank: int, where: str) -> None:
    """The hidden ``--stop-at-step N --fail-rank R --stop-where window|between``: a rank that stops (a
    hang in its own code, a GPU rank blocked on ``loss.item()``) inside its step window, or after it
    closed and before ``collect()``. It sleeps until a signal ends it."""
    if args.stop_at_step is not None and step == args.stop_at_step and rank == args.fail_rank \
            and args.stop_where == where:
        while True:
            time.sleep(3600)


def noise(args: argparse.Namespace, step: int) -> None:
    """The hidden ``--noise-bytes N``: every rank writes N bytes to stderr per step (a chatty library)."""
    if args.noise_bytes:
        line = f"noise step {step} ".ljust(99, ".") + "\n"
        sys.stderr.write(line * max(1, args.noise_bytes // 100))
        sys.stderr.flush()


def maybe_fail(args: argparse.Namespace, step: int, rank: int) -> None:
    """The hidden ``--fail-at-step N --fail-rank R``: the tests' stand-in for a rank that crashes."""
    if args.fail_at_step is not None and step == args.fail_at_step and rank == args.fail_rank:
        raise RuntimeError(f"injected failure on rank {rank} at step {step} (--fail-at-step)")
