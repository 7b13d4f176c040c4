"""Token-budget micro-batches, as verl's dynamic batch size makes them (``use_dynamic_bsz``).

verl's ``ppo_max_token_len_per_gpu`` is a target, not a cap: ``rearrange_micro_batches`` takes
``ceil(total tokens / budget)`` micro-batches and balances the sequences over them, so the heaviest can
exceed the budget. This does the same with a greedy longest-first balance on tokens; a sequence longer
than the budget is a micro-batch of its own. Plain Python: no torch.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


def pack(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Row indices of each micro-batch, in row order within one, heaviest micro-batch first."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1 token, got {budget}")
    n = len(lengths)
    if n == 0:
        return []
    k = min(n, max(1, math.ceil(sum(lengths) / budget)))
    bins: list[tuple[int, int, list[int]]] = [(0, b, []) for b in range(k)]
    for row in sorted(range(n), key=lambda r: -lengths[r]):
        tokens, b, rows = heapq.heappop(bins)  # the lightest micro-batch takes the longest sequence left
        rows.append(row)
        heapq.heappush(bins, (tokens + lengths[row], b, rows))
    packed = sorted(bins, key=lambda t: (-t[0], t[1]))
    return [sorted(rows) for _, _, rows in packed if rows]
