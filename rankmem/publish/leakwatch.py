"""The online leak watch on the logging rank: a ring of recent collects, judged every few steps
with the same verdicts ``rankmem leaks`` gives offline (:mod:`rankmem.trend.trend`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from rankmem.core.catalogue import LEAK_KEYS
from rankmem.core.records import StepRecord
from rankmem.core.warnings import warn
from rankmem.errors import RankmemError
from rankmem.trend import outlook as _outlook
from rankmem.trend.trend import LeakConfig, Trend, _window, outlook, phase_delta_keys, regression_axis, trends


class _LeakRing:
    """The leak watch's memory of the last ``capacity`` collects: their steps and times, the watched
    keys' values and the phase deltas (slot x key x rank, GiB, nan-padded), and each rank's latest finite
    capacity figure of each context key. Widened as ranks and phase keys appear."""

    def __init__(self, capacity: int, keys: int) -> None:
        self.capacity = capacity
        self.steps = np.zeros(capacity, dtype=np.int64)
        self.times = np.full(capacity, np.nan)
        self.values = np.full((capacity, keys, 0), np.nan)
        self.phases = np.full((capacity, 0, 0), np.nan)
        self.context = np.full((len(_outlook.CONTEXT_KEYS), 0), np.nan)
        self.next = 0
        """The slot the next collect goes to."""
        self.count = 0
        """Collects held (at most ``capacity``)."""
        self.fed = 0
        """Collects pushed so far."""

    @property
    def world(self) -> int:
        return int(self.values.shape[2])

    def widen(self, world: int, phase_keys: int) -> None:
        """Room for ``world`` ranks and ``phase_keys`` phase delta keys (nan-padded)."""
        if world > self.world:
            wider = np.full((self.capacity, self.values.shape[1], world), np.nan)
            wider[:, :, : self.world] = self.values
            self.values = wider
            context = np.full((self.context.shape[0], world), np.nan)
            context[:, : self.context.shape[1]] = self.context
            self.context = context
        if self.phases.shape[1:] != (phase_keys, self.world):
            phases = np.full((self.capacity, phase_keys, self.world), np.nan)
            phases[:, : self.phases.shape[1], : self.phases.shape[2]] = self.phases
            self.phases = phases

    def push(self, step: int, when: float, row: np.ndarray, phase_row: np.ndarray, context: np.ndarray) -> None:
        """One collect: ``row`` key x rank, ``phase_row`` phase key x rank, ``context`` context key x rank."""
        world = row.shape[1]
        self.widen(world, phase_row.shape[0])
        slot = self.next
        self.steps[slot], self.times[slot] = step, when
        self.values[slot] = np.nan
        self.values[slot, :, :world] = row
        self.phases[slot] = np.nan
        self.phases[slot, :, :world] = phase_row
        known = np.isfinite(context)
        self.context[:, :world][known] = context[known]
        self.next = (slot + 1) % self.capacity
        self.count = min(self.count + 1, self.capacity)
        self.fed += 1

    def last(self, take: int) -> np.ndarray:
        """The slots of the last ``take`` collects, oldest first."""
        return (self.next - take + np.arange(take)) % self.capacity


class LeakWatch:
    """Online leak check on the logging rank: feed it every collect; it warns once per rank and key.

    Keeps the last ``capacity`` values of each series in numpy ring buffers; the first ``warmup`` collects
    are never part of a window. Every series is judged on the window the offline verdict would take at this
    point, first all at once when that window lies wholly after the warm-up, then each (key, rank) again
    every ``max(1, min(check_every, window / 4))`` collects, spread evenly over the collects.
    :meth:`check` tests everything now. Online, a cache that fills for longer than the window seen so far
    looks like growth until it is freed. Ranks with the same ``r // ranks_per_node`` (default
    ``LOCAL_WORLD_SIZE``, else 1) draw on one host headroom.
    """

    def __init__(
        self,
        config: LeakConfig | None = None,
        keys: Sequence[str] = LEAK_KEYS,
        check_every: int = 250,
        capacity: int = 2000,
        warmup: int = 50,
        ranks_per_node: int | None = None,
    ) -> None:
        if check_every < 1 or capacity < 3 or warmup < 0:
            raise RankmemError("LeakWatch needs check_every >= 1, capacity >= 3 and warmup >= 0")
        self.warmup = warmup
        self.config = config or LeakConfig()
        self._judging = replace(self.config, window=1.0, last=None)  # the window is cut before judging
        self.keys = tuple(keys)
        self.check_every = check_every
        self.capacity = capacity
        if ranks_per_node is None:
            ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        self.ranks_per_node = max(ranks_per_node, 1)
        self._ring = _LeakRing(capacity, len(self.keys))
        self._phase_keys: list[str] = []
        """The phase delta keys the ring holds, in its order."""
        self._cursor = 0
        """The next series to test, counting key-major over (key, rank)."""
        self._credit = 0
        self._started = False
        self._layout: tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray] | None = None
        self.flagged: dict[tuple[str, int], Trend] = {}
        """(key, rank) -> the first trend that was flagged."""

    # ---- feeding ---------------------------------------------------------------------------------------
    def _columns(self, keys: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where the watched, phase-delta and context keys sit in ``keys``; looked up once per key set."""
        if self._layout is None or self._layout[0] != keys:
            where = {k: i for i, k in enumerate(keys)}
            for key in self.keys:
                for k in phase_delta_keys(key, keys).values():
                    if k not in self._phase_keys:
                        self._phase_keys.append(k)
            self._ring.widen(self._ring.world, len(self._phase_keys))
            self._layout = (
                keys,
                np.array([where.get(k, -1) for k in self.keys], dtype=np.intp),
                np.array([where.get(k, -1) for k in self._phase_keys], dtype=np.intp),
                np.array([where.get(k, -1) for k in _outlook.CONTEXT_KEYS], dtype=np.intp),
            )
        return self._layout[1], self._layout[2], self._layout[3]

    def feed_matrix(self, step: int, keys: Sequence[str], matrix: np.ndarray, when: float | None = None) -> list[Trend]:
        """Add one collect as the monitor gathers it: ``matrix[rank, i]`` is the rank's ``keys[i]``
        (nan where absent) at Unix time ``when`` (default: now). Only the watched keys', their phase
        deltas' and the capacity figures' columns are read. Returns newly flagged trends."""
        cols, phase_cols, context_cols = self._columns(tuple(keys))

        def take(columns: np.ndarray) -> np.ndarray:
            out = np.full((columns.size, matrix.shape[0]), np.nan)
            present = columns >= 0
            out[present] = matrix[:, columns[present]].T
            return out

        return self._push(step, take(cols), take(phase_cols), take(context_cols), time.time() if when is None else when)

    def feed(self, record: StepRecord) -> list[Trend]:
        """Add one step record (per-rank lists); returns the trends flagged for the first time."""
        if record.matrix is not None:
            return self.feed_matrix(record.step, tuple(record.keys), record.matrix, record.time)
        keys = tuple(record.ranks)
        world = max((len(v) for v in record.ranks.values()), default=0)
        matrix = np.full((world, len(keys)), np.nan)
        for i, vec in enumerate(record.ranks.values()):
            matrix[: len(vec), i] = [math.nan if v is None else v for v in vec]
        return self.feed_matrix(record.step, keys, matrix, record.time)

    def _push(self, step: int, row: np.ndarray, phase_row: np.ndarray, context: np.ndarray, when: float) -> list[Trend]:
        ring = self._ring
        ring.push(step, when, row, phase_row, context)
        take = self._take()
        if take is None:
            return []
        series = len(self.keys) * ring.world
        if not self._started:  # the first collect with a whole window: every series is judged on it
            self._started = True
            return self.check()
        interval = max(1, min(self.check_every, take // 4))
        due, self._credit = divmod(self._credit + series, interval)
        picked = [(self._cursor + i) % series for i in range(min(due, series))]
        if not picked:
            return []
        self._cursor = (picked[-1] + 1) % series
        ranks_of: dict[int, list[int]] = {}
        for s in picked:
            ranks_of.setdefault(s // ring.world, []).append(s % ring.world)
        return self._judge(ranks_of, take)

    def _take(self) -> int | None:
        """How many of the buffered collects a test examines now: the window the offline verdict would
        examine at this point (within what the buffer holds); None until that window lies wholly after
        the warm-up and has ``min_steps`` collects."""
        take = _window(self._ring.fed, self.config)
        if take > self._ring.fed - self.warmup or take < self.config.min_steps:
            return None
        return min(take, self._ring.count)

    def check(self) -> list[Trend]:
        """Test every series now; warn for and return trends flagged for the first time."""
        take = self._take()
        if take is None:
            return []
        everyone = list(range(self._ring.world))
        return self._judge({k: everyone for k in range(len(self.keys))}, take)

    # ---- judging ---------------------------------------------------------------------------------------
    def _judge(self, ranks_of: dict[int, list[int]], take: int) -> list[Trend]:
        """Test the given ranks of the given keys (by index) on the last ``take`` buffered collects."""
        order = self._ring.last(take)
        steps, axis = self._axis(order)
        new: list[Trend] = []
        for k, ranks in ranks_of.items():
            key = self.keys[k]
            todo = [r for r in ranks if (key, r) not in self.flagged]
            if not todo:
                continue
            columns = self._ring.values[order[:, None], k, np.asarray(todo)]
            caps = [_outlook.capacity_gib(key, self._rank_context(r), self.ranks_per_node) for r in todo]
            for t in trends(steps, columns, key, todo, self._judging, caps):
                t = t if axis == "step" else replace(t, axis=axis)
                if t.leak:
                    self.flagged[(key, t.rank)] = t
                    new.append(t)
        if not new:
            return []
        new = self._outlook(new, order)
        for t in new:
            self.flagged[(t.key, t.rank)] = t
            warn(f"rankmem: possible memory leak on {t.describe()}", stacklevel=4)
        return new

    def _axis(self, order: np.ndarray) -> tuple[np.ndarray, str]:
        """The buffered collects' steps, or their places in the run where the steps do not rise."""
        return regression_axis(self._ring.steps[order], first=self._ring.fed - order.size)

    def _rank_context(self, rank: int) -> dict[str, float | None]:
        return {k: float(self._ring.context[i, rank]) for i, k in enumerate(_outlook.CONTEXT_KEYS)}

    def _outlook(self, new: list[Trend], order: np.ndarray) -> list[Trend]:
        """Phase and exhaustion of the newly flagged trends; the node's rate counts every host leak
        flagged on it so far."""
        ring = self._ring
        (steps, _), times = self._axis(order), ring.times[order]
        earlier = [t for t in self.flagged.values() if t not in new]

        def current(t: Trend) -> float | None:
            column = ring.values[order, self.keys.index(t.key), t.rank]
            return _outlook.fitted_last(steps, column, t.slope_mib, t.last_step)

        def deltas(t: Trend) -> dict[str, np.ndarray]:
            names = phase_delta_keys(t.key, self._phase_keys)
            return {p: ring.phases[order, self._phase_keys.index(k), t.rank] for p, k in names.items()}

        return outlook(new, current, self._rank_context, lambda r: r // self.ranks_per_node,
                       _outlook.seconds_per_step(steps, times), deltas, earlier)
