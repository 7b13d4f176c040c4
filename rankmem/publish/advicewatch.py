"""The online advice watch on the logging rank: warns once per phase when the memory model, fitted on
the run's own windows, puts the peak at the heaviest micro-batch seen over capacity minus headroom.

The same series, fit, capacity and verdict as ``rankmem advise`` (:mod:`rankmem.fit.series`,
:mod:`rankmem.fit.capacity`), over the last :data:`HISTORY` collects. Refitted every ``every`` collects.

Its first fit leaves ~2 MiB resident (numpy's code and workspaces): the publisher takes that on every
rank when it is made (:func:`rankmem.fit.prime`), not here at the 10th collect.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from rankmem.core.catalogue import phase_names, work_key
from rankmem.core.warnings import warn
from rankmem.errors import RankmemError
from rankmem.fit.capacity import Limit, Verdict, limit, verdict
from rankmem.fit.series import fit_ranks, memory_kind

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
        self.limit: Limit | None = None
        self.verdicts: dict[str, Verdict] = {}
        """The latest verdict of each phase (for tests and a reader of the watch)."""

    def feed_matrix(self, step: int, keys: Sequence[str], matrix: np.ndarray) -> list[str]:
        """Take one collect; every ``every`` collects, judge. Returns the warnings given (for tests)."""
        self.fed += 1
        self.history.append((step, {k: np.array(matrix[:, i], dtype=np.float64) for i, k in enumerate(keys)}))
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
        phases = [p for p in phase_names(list(series)) if work_key(p, "mb_tokens") in series]
        if not phases:
            return []
        warmup = WARMUP if self.fed <= HISTORY else 0  # the warm-up collects have left the history
        world = next(iter(series.values())).shape[1]
        hosts = self.hosts if len(self.hosts) == world else ["?"] * world  # unknown: all share one node
        try:
            self.limit = limit(series, hosts, memory_kind(series, phases[0]))
        except RankmemError:  # no capacity measured: nothing to judge against
            return []
        given = []
        for phase in phases:
            found = self.verdicts[phase] = verdict(fit_ranks(series, steps, phase, warmup), self.limit)
            if found.fits is False and phase not in self.warned:
                self.warned.add(phase)
                lim = self.limit
                message = (f"rankmem: phase {phase}: the fitted peak at its heaviest micro-batch seen ({found.tokens:.0f} "
                           f"tokens, rank {found.rank}) is {found.high_gib:.3f} GiB, over capacity minus headroom "
                           f"({lim.usable:.3f} of {lim.capacity:.3f} GiB, {lim.source}): lower its token budget "
                           f"(rankmem advise RUN says how far)")
                warn(message, stacklevel=2)
                given.append(message)
        return given
