"""Data the package generates: no downloads, the same batches for the same (seed, rank, step).

- SFT: arithmetic sequences modulo the vocabulary (``x[i] = start + i * stride``, stride 1..3). The
  first two tokens fix the rule, so a model that learns it drives the loss of the rest towards 0.
- GRPO: a random prompt; the verifiable reward is how well the response counts up from the prompt's
  last token (``last + 1, last + 2, ...`` modulo the vocabulary): the target pattern.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rankmem.errors import RankmemError

Batch = dict[str, torch.Tensor]
"""A batch: ``input_ids`` (B, T) int64 and ``loss_mask`` (B, T - 1) over the predicted tokens, plus
task fields (``advantages`` (B,), ``old_log_probs`` (B, T - 1))."""


def _generator(seed: int, rank: int, step: int) -> torch.Generator:
    # Distinct, reproducible streams per rank and step: each rank sees its own shard of the data.
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    return g


@dataclass
class ArithmeticSFT:
    """Next-token data: arithmetic sequences modulo ``vocab_size``."""

    vocab_size: int
    seq_len: int
    batch_size: int
    seed: int = 0

    def batch(self, rank: int, step: int) -> Batch:
        g = _generator(self.seed, rank, step)
        start = torch.randint(0, self.vocab_size, (self.batch_size, 1), generator=g)
        stride = torch.randint(1, 4, (self.batch_size, 1), generator=g)
        ids = (start + stride * torch.arange(self.seq_len)) % self.vocab_size
        return {"input_ids": ids, "loss_mask": torch.ones(self.batch_size, self.seq_len - 1)}


@dataclass
class CountingTask:
    """Prompts for the toy RL task and its verifiable reward."""

    vocab_size: int
    prompt_len: int
    response_len: int
    prompts_per_rank: int
    group_size: int
    seed: int = 0

    def prompts(self, rank: int, step: int) -> torch.Tensor:
        """``prompts_per_rank`` prompts, each repeated ``group_size`` times (consecutive rows)."""
        g = _generator(self.seed, rank, step)
        p = torch.randint(0, self.vocab_size, (self.prompts_per_rank, self.prompt_len), generator=g)
        return p.repeat_interleave(self.group_size, dim=0)

    def lengths(self, rank: int, step: int, shortest: int, longest: int) -> torch.Tensor:
        """Heavy-tailed sequence lengths of step ``step``'s rows (its own stream: the prompts stay as they are)."""
        g = _generator(self.seed + 0x5EED, rank, step)
        return heavy_tailed_lengths(g, self.prompts_per_rank * self.group_size, shortest, longest)

    def reward(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Fraction of response tokens that are their predecessor + 1 (modulo the vocabulary), the
        first one continuing the prompt's last token; (B,). A sampled token scores even after a wrong
        one, so the credit is dense enough for a few dozen steps to show learning."""
        prev = torch.cat([prompts[:, -1:], responses[:, :-1]], dim=1)
        return (responses == (prev + 1) % self.vocab_size).float().mean(dim=1)

    def response_mask(self, batch_size: int) -> torch.Tensor:
        """Loss mask over the predicted tokens (B, T - 1): only the response is trained on."""
        t = self.prompt_len + self.response_len
        mask = torch.zeros(batch_size, t - 1)
        mask[:, self.prompt_len - 1 :] = 1.0
        return mask


def heavy_tailed_lengths(g: torch.Generator, n: int, shortest: int, longest: int, alpha: float = 1.3) -> torch.Tensor:
    """``n`` sequence lengths in ``shortest..longest``: ``shortest`` times a Pareto(``alpha``) draw, capped,
    as RL rollouts are long-tailed (most responses short, a few near the limit); (n,) int64."""
    u = torch.rand(n, generator=g, dtype=torch.float64).clamp_min(1e-12)
    lengths = (shortest * u.pow(-1.0 / alpha)).floor().clamp(shortest, longest)
    return lengths.to(torch.int64)


def extend_counting(seqs: torch.Tensor, lengths: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Rows of ``seqs`` continued to ``lengths`` (zero-padded to the longest) by the target pattern.

    A stand-in for long rollouts: sampling hundreds of tokens per response without a KV cache would
    dominate a CPU step, and the memory of log_prob and update depends on the lengths, not the tokens."""
    longest = int(lengths.max())
    out = torch.zeros(seqs.shape[0], longest, dtype=seqs.dtype)
    out[:, : seqs.shape[1]] = seqs[:, :longest]
    tail = longest - seqs.shape[1]
    if tail > 0:
        out[:, seqs.shape[1] :] = (seqs[:, -1:] + torch.arange(1, tail + 1)) % vocab_size
    out[torch.arange(longest) >= lengths[:, None]] = 0
    return out


def group_normalised_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's advantage: each reward minus its group's mean, over the group's standard deviation. A
    group whose rewards agree gets 0; a group of one has no deviation, so ``group_size`` must be >= 2."""
    if group_size < 2:
        raise RankmemError(f"group_size must be >= 2, got {group_size}: one response per prompt has no group standard "
                           "deviation")
    r = rewards.view(-1, group_size)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)
