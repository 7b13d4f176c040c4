"""A phase's token budget, how far realised micro-batches overshot it, and verl's names for the advice.

verl's ``*_max_token_len_per_gpu`` is a target its balanced packing may exceed (the heaviest
micro-batch of a mini-batch is often over it), so the advised budget is the largest tokens that fit
divided by the largest overshoot seen. Offline code: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rankmem.core.catalogue import work_key
from rankmem.core.scalars import WORK_MAX
from rankmem.offline import Run


@dataclass(frozen=True)
class VerlNames:
    """verl's config keys that size one phase: the dynamic token budget and the fixed micro-batch size."""

    budget: tuple[str, ...]
    micro_batch: tuple[str, ...]
    run_config: str
    """The reference worker's run-config name of the phase's budget."""


_ACTOR = VerlNames(("actor_rollout_ref.actor.ppo_max_token_len_per_gpu",),
                   ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",), "ppo_max_token_len_per_gpu")
_LOG_PROB = VerlNames(("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                       "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"),
                      ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                       "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"), "log_prob_max_token_len_per_gpu")
_REF = VerlNames(("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",),
                 ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",), "ref_log_prob_max_token_len_per_gpu")
_CRITIC = VerlNames(("critic.ppo_max_token_len_per_gpu",), ("critic.ppo_micro_batch_size_per_gpu",),
                    "critic_ppo_max_token_len_per_gpu")
PHASE_NAMES: dict[str, VerlNames] = {
    **dict.fromkeys(("update", "update_actor", "actor_update", "train", "update_policy"), _ACTOR),
    **dict.fromkeys(("log_prob", "old_log_prob", "compute_log_prob"), _LOG_PROB),
    **dict.fromkeys(("ref", "ref_log_prob", "compute_ref_log_prob"), _REF),
    **dict.fromkeys(("critic", "update_critic", "values", "compute_values"), _CRITIC),
}
"""Phase names (the reference worker's and verl's own method names) -> the config keys that size them."""


def verl_names(phase: str) -> VerlNames | None:
    return PHASE_NAMES.get(phase)


def configured_budget(run: Run, phase: str) -> int | None:
    """The phase's token budget from the run's config: the reference worker's name, or verl's dotted one."""
    names = verl_names(phase)
    run_config = run.header.config.get("run") or {}
    if names is None or not isinstance(run_config, Mapping):
        return None
    for name in (names.run_config, *names.budget):
        value = _lookup(run_config, name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return int(value)
    return None


def _lookup(config: Mapping[str, Any], dotted: str) -> Any:
    if dotted in config:
        return config[dotted]
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _heaviest(run: Run, phase: str, first: int) -> np.ndarray:
    """The heaviest micro-batch's tokens from row ``first`` on; NaN past any real count (an overflowed
    counter in one window must not set the overshoot)."""
    tokens = run.series[work_key(phase, "mb_tokens")][first:]
    with np.errstate(invalid="ignore"):
        return np.where(tokens <= WORK_MAX, tokens, np.nan)


def overshoot(run: Run, phase: str, budget: int, warmup: int) -> float:
    """The largest heaviest-micro-batch tokens over ``budget`` after warm-up, any rank (at least 1)."""
    tokens = _heaviest(run, phase, min(warmup, run.steps.size))
    finite = tokens[np.isfinite(tokens)]
    return max(1.0, float(finite.max()) / budget) if finite.size else 1.0


def over_budget(run: Run, phase: str, budget: int, warmup: int = 0) -> list[tuple[int, int, float]]:
    """(step, rank, ratio) of every window after warm-up whose heaviest micro-batch exceeded ``budget``,
    worst first."""
    first = min(warmup, run.steps.size)
    tokens = _heaviest(run, phase, first)
    rows, ranks = np.nonzero(np.where(np.isfinite(tokens), tokens, 0) > budget)
    out = [(int(run.steps[first + r]), int(k), float(tokens[r, k]) / budget) for r, k in zip(rows, ranks, strict=True)]
    return sorted(out, key=lambda t: -t[2])


def micro_batch_size(max_tokens: int, longest: float) -> int | None:
    """Sequences per fixed-size micro-batch when each may be ``longest`` tokens long."""
    return max(1, math.floor(max_tokens / longest)) if longest >= 1 else None
