"""The online advice watch on the logging rank: warns once per phase when the memory model, fitted on
the run's own windows, puts the peak at the heaviest micro-batch seen over capacity minus headroom.

The same model as ``rankmem advise`` (:func:`rankmem.fit.fit_phase`), on the host's peak RSS over the
lowest RSS between steps, or the device's peak allocated over the step's allocated, scaled by the
allocator's overhead (:func:`rankmem.fit.overhead_ratio`), plus the memory outside torch. Capacity: the device total, else the cgroup limit, else the
node's memory shared by the ranks on the node. Headroom: 5% of it. Refitted every ``every`` collects.

Its first fit leaves ~2 MiB resident (numpy's code and workspaces): the publisher takes that on every
rank when it is made (:func:`rankmem.fit.prime`), not here at the 10th collect.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from rankmem.core.catalogue import key_of, phase_key, phase_names, work_key
from rankmem.core.warnings import warn
from rankmem.fit import Fit, NoFit, fit_phase, grew_pool, overhead_ratio
from rankmem.fit.held import HELD_PARTS, held_state

HEADROOM_FRACTION = 0.05
WARMUP = 2
HISTORY = 256


class AdviceWatch:
    """Fed every detail collect's rank x key matrix; warns once per phase."""

    def __init__(self, ranks_per_node: int = 1, every: int = 10) -> None:
        self.ranks_per_node = max(1, ranks_per_node)
        self.every = every
        self.fed = 0
        self.warned: set[str] = set()
        self.history: dict[tuple[str, int], deque[tuple[float, ...]]] = {}
        self.capacity: float | None = None
        self.device: dict[str, bool] = {}

    def feed_matrix(self, step: int, keys: Sequence[str], matrix: np.ndarray) -> list[str]:
        """Take one collect; every ``every`` collects, judge. Returns the warnings given (for tests)."""
        self.fed += 1
        index = {k: i for i, k in enumerate(keys)}
        self._capacity(index, matrix)
        if self.fed <= WARMUP:
            return []
        for phase in phase_names(keys):
            if work_key(phase, "mb_tokens") in index:
                self._push(phase, index, matrix)
        return self._judge() if self.fed % self.every == 0 else []

    def _capacity(self, index: dict[str, int], matrix: np.ndarray) -> None:
        def smallest(key: str) -> float | None:
            col = index.get(key)
            if col is None:
                return None
            values = matrix[:, col][np.isfinite(matrix[:, col])]
            return float(values.min()) if values.size else None

        total = smallest(key_of("total"))
        limit = smallest(key_of("cgroup_limit"))
        used, avail = smallest(key_of("node_used")), smallest(key_of("node_available"))
        node = used + avail if used is not None and avail is not None else None
        host = limit if limit is not None else node
        self.capacity = total if total is not None else host / self.ranks_per_node if host is not None else None

    def _push(self, phase: str, index: dict[str, int], matrix: np.ndarray) -> None:
        device = phase_key(phase, "peak_allocated_gib") in index
        cols = [index.get(work_key(phase, "mb_tokens")), index.get(work_key(phase, "mb_sq_tokens"))]
        peak_col = index.get(phase_key(phase, "peak_allocated_gib" if device else "peak_rss_gib"))
        base_col = index.get(key_of("allocated" if device else "rss"))
        # Device: the phase's peak reserved and its rise in the window (the allocator's ratio), and the
        # memory outside torch.
        extra_cols = [index.get(phase_key(phase, k)) for k in ("peak_reserved_gib", "peak_reserved_rise_gib")]
        extra_cols.append(index.get(key_of("other")))
        held_cols = [index.get(phase_key(phase, f"anatomy/{p}_gib")) for p in HELD_PARTS]
        if cols[0] is None or peak_col is None or base_col is None:
            return
        for rank in range(matrix.shape[0]):
            row = matrix[rank]
            q = row[cols[1]] if cols[1] is not None else np.nan
            reserved, rise, other = (float(row[c]) if device and c is not None else np.nan for c in extra_cols)
            low, high, o = (float(row[c]) if c is not None else np.nan for c in held_cols)
            entry = (float(row[cols[0]]), float(q), float(row[peak_col]), float(row[base_col]), reserved,
                     rise, other, low, high, o)
            self.history.setdefault((phase, rank), deque(maxlen=HISTORY)).append(entry)
        self.device[phase] = device

    def _series(self, key: tuple[str, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, float, float, float]:
        """(T, rise, Q or None, baseline, the allocator's ratio, other) of one phase and rank, from its history."""
        t, q, peak, base, reserved, rise, other, low, high, o = (np.array(c) for c in zip(*self.history[key],
                                                                                           strict=True))
        held, static = held_state(low, high, o)  # peak anatomy: as in rankmem.offline.advice
        device = self.device[key[0]]
        baseline = float(np.nanmin(base)) if not device else float(np.nanmedian(base[-5:]))
        ratio, outside = 1.0, 0.0
        if device:
            ratio = overhead_ratio(peak, reserved, grew_pool(reserved, peak, rise if np.isfinite(rise).any() else None))
            finite = other[np.isfinite(other)]
            outside = max(float(finite.max()), 0.0) if finite.size else 0.0
        rise_of = peak - (base if device else baseline) - held
        return t, rise_of, q if np.isfinite(q).all() else None, baseline + static, ratio, outside

    def _judge(self) -> list[str]:
        given: list[str] = []
        if self.capacity is None:
            return given
        usable = self.capacity * (1 - HEADROOM_FRACTION)
        series = {key: self._series(key) for key in self.history if key[0] not in self.warned}
        fits: dict[tuple[str, int], Fit | NoFit] = {}
        for phase in {p for p, _ in series}:
            keys = [key for key in series if key[0] == phase]
            fits.update(zip(keys, fit_phase([series[key][:3] for key in keys]), strict=True))
        for (phase, rank), (t, _, _, baseline, ratio, outside) in series.items():
            if phase in self.warned:
                continue
            fit = fits[(phase, rank)]
            if not isinstance(fit, Fit):
                continue
            heaviest = float(np.nanmax(t))
            high = (baseline + fit.predict(heaviest)[2]) * ratio + outside
            if high > usable:
                self.warned.add(phase)
                message = (f"rankmem: phase {phase}: the fitted peak at its heaviest micro-batch seen ({heaviest:.0f} "
                           f"tokens, rank {rank}) is {high:.3f} GiB, over capacity minus headroom ({usable:.3f} of "
                           f"{self.capacity:.3f} GiB): lower its token budget (rankmem advise RUN says how far)")
                warn(message, stacklevel=2)
                given.append(message)
        return given
