"""The engine's pure pieces, in-process: generated data, rewards, advantages, LR schedule, config errors."""

from __future__ import annotations

import math

import pytest
import torch

from rankmem.engine.data import ArithmeticSFT, CountingTask, group_normalised_advantages
from rankmem.engine.model import GPT, GPTConfig
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
