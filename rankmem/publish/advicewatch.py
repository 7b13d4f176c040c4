"""The online advice watch on the logging rank: warns once per phase when the memory model, fitted on
the run's own windows, puts the peak at the heaviest micro-batch seen over capacity minus headroom.

The same series, fit, capacity and verdict as ``rankmem advise`` (:mod:`rankmem.fit.series`,
:mod:`rankmem.fit.capacity`), over the last :data:`HISTORY` collects. Refitted every ``every`` collects.

Its first fit leaves ~2 MiB resident (numpy's code and workspaces): the publisher takes that on every
rank when it is made (:func:`rankmem.fit.pooled.prime`), not here at the 10th collect.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from rankmem.core.warnings import warn
from rankmem.fit.capacity import Assessment, assess, read_by_assess

WARMUP = 2
HISTORY = 256


class AdviceWatch:
    """Fed every detail collect's rank x key matrix; warns once per phase."""

    def __init__(self, hosts: Sequence[str] = (), every: int = 10) -> None:
        self.hosts = list(hosts)
        self.every = every
        self.fed = 0
        self.warned: set[str] = set()
        self.history: deque[tuple[int, dict[str, np.ndarray]]] = deque(maxlen=HISTORY)
        self.assessment: Assessment | None = None
        """The latest limit and verdicts (as ``rankmem report`` gives them)."""

    def feed_matrix(self, step: int, keys: Sequence[str], matrix: np.ndarray) -> list[str]:
        """Take one collect; every ``every`` collects, judge. Returns the warnings given (for tests)."""
        self.fed += 1
        self.history.append((step, {k: np.array(matrix[:, i], dtype=np.float64) for i, k in enumerate(keys)
                                    if read_by_assess(k)}))
        if self.fed <= WARMUP or self.fed % self.every:
            return []
        return self.judge()

    def series(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The history as the run log's arrays: steps, and key -> (collects x ranks), nan where absent."""
        world = max(row.size for _, rows in self.history for row in rows.values())
        keys = {k for _, rows in self.history for k in rows}
        empty = np.full(world, math.nan)
        return (np.array([s for s, _ in self.history]),
                {k: np.vstack([rows.get(k, empty) for _, rows in self.history]) for k in keys})

    def judge(self) -> list[str]:
        """Fit every phase told its micro-batches on the history; warn for a phase newly over."""
        steps, series = self.series()
        world = next(iter(series.values())).shape[1]
        hosts = self.hosts if len(self.hosts) == world else ["?"] * world  # unknown: all share one node
        warmup = WARMUP if self.fed <= HISTORY else 0  # the warm-up collects have left the history
        self.assessment = found = assess(series, steps, hosts, warmup)
        given = []
        for v in found.verdicts:
            if v.fits is False and v.phase not in self.warned and found.limit is not None:
                self.warned.add(v.phase)
                lim = found.limit
                message = (f"rankmem: phase {v.phase}: the fitted peak at its heaviest micro-batch "
                           f"seen ({v.tokens:.0f} tokens, rank {v.rank}) is {v.high_gib:.3f} GiB, over "
                           f"capacity minus headroom ({lim.usable:.3f} of {lim.capacity:.3f} GiB, "
                           f"{lim.source}): lower its token budget (rankmem advise RUN says how far)")
                warn(message, stacklevel=2)
                given.append(message)
        return given
