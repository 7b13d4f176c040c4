"""Token-budget micro-batches: verl's balanced packing, the packed forward, and the worker telling the
monitor each micro-batch's work on real gloo ranks."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from rankmem.core.catalogue import work_key
from rankmem.engine.data import CountingTask
from rankmem.engine.model import GPT, GPTConfig
from rankmem.engine.packing import pack
from rankmem.engine.tasks import GRPO_VOCAB, PROMPT_LEN, RESPONSE_LEN
from rankmem.offline import read_run
from tests.conftest import torchrun


def test_pack_takes_ceil_total_over_budget_micro_batches_and_balances_them() -> None:
    rng = random.Random(3)
    for _ in range(200):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 60))]
        budget = rng.randint(300, 2000)
        bins = pack(lengths, budget)
        assert sorted(r for b in bins for r in b) == list(range(len(lengths)))  # every row once
        assert len(bins) == min(len(lengths), math.ceil(sum(lengths) / budget))
        loads = [sum(lengths[r] for r in b) for b in bins]
        assert loads == sorted(loads, reverse=True)
        # Longest-first greedy: the heaviest is within one sequence of the mean load.
        assert loads[0] <= sum(lengths) / len(bins) + max(lengths)
    # A target, not a cap: 3 x 60 in a budget of 100 is 2 micro-batches, the heavier 120 tokens.
    assert pack([60, 60, 60], 100) == [[0, 2], [1]]
    with pytest.raises(ValueError, match="budget must be >= 1"):
        pack([1], 0)


@pytest.mark.parametrize("attention", ["sdpa", "materialized"])
def test_a_packed_row_computes_what_each_sequence_alone_does(attention: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, block_size=64, attention=attention)).eval()
    seqs = [torch.randint(0, 16, (n,)) for n in (5, 17, 64, 1, 30)]
    packed = model(torch.cat(seqs)[None], [len(s) for s in seqs])[0]
    alone = torch.cat([model(s[None])[0] for s in seqs])
    assert torch.allclose(packed, alone, atol=1e-5)


def test_the_packed_job_tells_each_phase_its_heaviest_micro_batch_and_largest_q_per_rank(tmp_path: Path) -> None:
    budget, longest, steps = 600, 128, 3
    argv = ["--out", str(tmp_path), "--no-progress", "--steps", str(steps), "--ppo-max-token-len-per-gpu",
            str(budget), "--max-seq-len", str(longest), "--attention", "materialized", "--prompts-per-rank", "4"]
    proc = torchrun("rankmem.engine.train", 2, argv, extra=["-m"], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = read_run(str(tmp_path))
    assert run.header.config["run"]["ppo_max_token_len_per_gpu"] == budget
    task = CountingTask(GRPO_VOCAB, PROMPT_LEN, RESPONSE_LEN, 4, 8, seed=0)
    for step in range(steps):
        for rank in range(2):
            lengths = task.lengths(rank, step, PROMPT_LEN + RESPONSE_LEN, longest).tolist()
            bins = pack(lengths, budget)
            heaviest = [lengths[r] for r in bins[0]]
            for phase in ("log_prob", "update"):
                got = {f: run.series[work_key(phase, f)][step, rank] for f in
                       ("mb_tokens", "mb_sequences", "mb_sq_tokens", "tokens", "micro_batches")}
                assert got == {"mb_tokens": sum(heaviest), "mb_sequences": len(heaviest),
                               "mb_sq_tokens": max(sum(lengths[r] ** 2 for r in rows) for rows in bins),
                               "tokens": sum(lengths),
                               "micro_batches": len(bins)}, (phase, step, rank)
    # The rollout has no micro-batches: no work keys there.
    assert work_key("rollout", "mb_tokens") not in run.series
