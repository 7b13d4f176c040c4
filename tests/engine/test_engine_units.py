"""The engine's pure pieces, in-process: generated data, rewards, advantages, LR schedule, config errors."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from rankmem.engine.data import ArithmeticSFT, CountingTask, group_normalised_advantages
from rankmem.engine.model import GPT, GPTConfig
from rankmem.engine.options import add_job_arguments, resolve_job_options
from rankmem.engine.worker import WorkerConfig, _lr_lambda, make_pg_loss, sft_loss
from rankmem.errors import RankmemError


def test_sft_data_follows_its_rule_and_differs_per_rank() -> None:
    data = ArithmeticSFT(vocab_size=32, seq_len=10, batch_size=4, seed=1)
    b = data.batch(rank=0, step=0)
    ids = b["input_ids"]
    stride = (ids[:, 1] - ids[:, 0]) % 32
    assert ((ids[:, 1:] - ids[:, :-1]) % 32 == stride[:, None]).all()
    assert set(stride.tolist()) <= {1, 2, 3}
    assert torch.equal(ids, data.batch(0, 0)["input_ids"])
    assert not torch.equal(ids, data.batch(1, 0)["input_ids"])
    assert b["loss_mask"].shape == (4, 9)


def test_counting_reward_is_exact() -> None:
    task = CountingTask(vocab_size=16, prompt_len=2, response_len=4, prompts_per_rank=1, group_size=1)
    prompts = torch.tensor([[3, 15], [3, 15], [0, 7]])
    responses = torch.tensor([[0, 1, 2, 3], [0, 5, 6, 9], [9, 9, 9, 9]])
    assert task.reward(prompts, responses).tolist() == [1.0, 0.5, 0.0]
    mask = task.response_mask(3)
    assert mask.shape == (3, 5) and mask[0].tolist() == [0, 1, 1, 1, 1]  # predicts tokens 2..5


def test_group_advantages_are_zero_mean_unit_std_per_group() -> None:
    adv = group_normalised_advantages(torch.tensor([0.0, 1.0, 0.5, 0.5, 2.0, 4.0]), group_size=2)
    assert adv.tolist() == pytest.approx([-0.7071, 0.7071, 0.0, 0.0, -0.7071, 0.7071], abs=1e-3)
    with pytest.raises(RankmemError) as info:  # was NaN advantages, so every optimizer step was skipped
        group_normalised_advantages(torch.tensor([0.0, 1.0]), group_size=1)
    assert str(info.value) == "group_size must be >= 2, got 1: one response per prompt has no group standard deviation"


def test_pg_loss_pushes_towards_positive_advantage() -> None:
    lp = torch.zeros(2, 3, requires_grad=True)
    batch = {"old_log_probs": torch.zeros(2, 3), "advantages": torch.tensor([1.0, -1.0]), "loss_mask": torch.ones(2, 3)}
    make_pg_loss()(lp, batch).backward()
    assert lp.grad is not None
    assert (lp.grad[0] < 0).all() and (lp.grad[1] > 0).all()  # descent raises row 0's log-probs
    assert sft_loss(torch.full((2, 3), -2.0), batch).item() == pytest.approx(12.0)


def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    f = _lr_lambda(WorkerConfig(warmup_steps=4, total_steps=20, min_lr_ratio=0.1))
    assert f(0) == pytest.approx(0.2) and f(3) == pytest.approx(0.8) and f(4) == pytest.approx(1.0)
    assert f(20) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(4, 30))


def test_model_size_and_initial_loss() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    assert 2e5 < model.num_params() < 5e6
    ids = torch.randint(0, 32, (4, 16))
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 32), ids[:, 1:].reshape(-1))
    assert abs(loss.item() - math.log(32)) < 0.1
    with pytest.raises(RankmemError, match="exceeds block_size 32"):
        model(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"engine": "zero3"}, "unknown engine 'zero3': choose from ddp, fsdp"),
        ({"micro_batch_size": 0}, "micro_batch_size must be >= 1, got 0"),
        ({"peak_tflops": 0.0}, "peak_tflops must be > 0, got 0.0"),
    ],
)
def test_worker_config_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(RankmemError) as info:
        WorkerConfig(**kwargs)  # type: ignore[arg-type]
    assert str(info.value) == message


def _job(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_job_arguments(parser)
    args = parser.parse_args(argv)
    resolve_job_options(args)
    return args


def test_job_defaults_follow_the_task() -> None:
    grpo, sft, mine = _job(), _job("--task", "sft"), _job("--steps", "7", "--lr", "0.01")
    assert (grpo.task, grpo.steps, grpo.lr) == ("grpo", 400, 5e-3)  # `make demo`: about two minutes on 2 cores
    assert (sft.steps, sft.lr) == (40, 3e-3)
    assert (mine.steps, mine.lr) == (7, 0.01)


def test_fsdp2_names_the_fsdp_engine_and_sft_ignores_the_group_size() -> None:
    assert _job("--engine", "fsdp2").engine == "fsdp"  # README calls it FSDP2
    assert _job("--task", "sft", "--group-size", "1").group_size == 1  # only GRPO groups responses


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
        (["--prompts-per-rank", "0"], "--prompts-per-rank must be >= 1, got 0"),
        (["--group-size", "1"], "--group-size must be >= 2, got 1: GRPO's advantage is a response's reward against "
                                "its group's mean and standard deviation, which one response per prompt does not have"),
        (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
        (["--peak-tflops", "nan"], "--peak-tflops must be a finite number > 0, got nan"),
        (["--pg-timeout-s", "-1"], "--pg-timeout-s must be a number of seconds in 1..31536000 (a year), got -1.0"),
        (["--fail-at-step", "2", "--fail-rank", "-1"], "--fail-rank must be >= 0, got -1"),
    ],
)
def test_job_option_errors(argv: list[str], message: str) -> None:
    with pytest.raises(RankmemError) as info:
        _job(*argv)
    assert str(info.value) == message



def test_train_summary_names_each_keys_worst_rank_at_its_worse_end() -> None:
    from types import SimpleNamespace

    from rankmem.engine.train import PeakTracker

    peak, headroom = "mem/device/peak_reserved_gib", "mem/device/headroom_gib"
    tracker = PeakTracker(SimpleNamespace(last_record=None))  # type: ignore[arg-type]
    for step, (peak_max, peak_rank, room_min, room_rank) in enumerate([(3.0, 2, 5.0, 0), (2.0, 0, 1.5, 1), (4.0, 1, 2.0,
                                                                                                            2)]):
        tracker.update(step, {f"{peak}/max": peak_max, f"{peak}/max_rank": peak_rank, f"{peak}/min": 0.1,
                              f"{peak}/min_rank": 3, f"{headroom}/max": 9.0, f"{headroom}/max_rank": 3,
                              f"{headroom}/min": room_min, f"{headroom}/min_rank": room_rank})
    assert (tracker.peaks[peak].value, tracker.peaks[peak].rank, tracker.peaks[peak].step) == (4.0, 1, 2)
    # Low is bad for headroom: the summary names the rank with the least, not the safest one.
    held = tracker.peaks[headroom]
    assert (held.stat, held.value, held.rank, held.step) == ("min", 1.5, 1, 1)
    assert tracker.lines()[1].split() == [headroom, "min", "1.500", "GiB", "rank", "1", "step", "1", "phase", "-"]
