"""The large-world collective: aggregates by all-reduce, per-rank detail gathered to one rank now and then.

Each rank sends and receives ``O(K)`` floats whatever the world size ``W``, where an all-gather costs
``W x K``:

1. all-reduce MAX of ``[sig, -sig, n, step, -step, detail, v, -v, isnan]`` (absent or NaN -> -inf in
   ``v``/``-v``): max, min, whether the layouts agree, whether any rank wants the detail;
2. all-reduce SUM of ``[v, present, histogram]`` (absent or NaN -> 0): mean, and p50/p90/p99 across
   ranks from a histogram of ``bins`` buckets per key over ``[min, max]`` (exact to one bucket);
3. all-reduce MIN of ``[r if v == max, r if v == min, r if isnan]`` (else ``W``): the ranks.

Every rank decides from the same reduced vectors, so all take the same branch: a disagreement seen
in (1) makes every rank skip (2) and (3) and take the pickled fallback together; no hang.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from rankmem.exchange.packed import PackedGather

_HEAD = 6
"""``[sig, -sig, n, step, -step, detail]`` ahead of the values in the MAX vector."""


@dataclass(slots=True)
class Reduced:
    """One collect's aggregates over the agreed layout (``None`` from :meth:`PackedReduce.reduce`
    when the ranks disagree and must take the fallback)."""

    stats: np.ndarray
    """keys x 5: max, min, mean, max_rank, min_rank (NaN and -1 for keys no rank has)."""
    counts: np.ndarray
    """Per key, how many ranks have it."""
    detail: np.ndarray | None
    """ranks x keys on the detail rank when this collect carries the detail (NaN where absent)."""
    quantiles: np.ndarray | None
    """keys x len(QUANTILES): p50, p90, p99 across ranks (upper bucket edges), or None with ``bins=0``."""


QUANTILES = (0.5, 0.9, 0.99)
QUANTILE_NAMES = ("p50", "p90", "p99")


class PackedReduce:
    """Three fixed-size all-reduces over a :class:`PackedGather`'s group, device and learned capacity.

    Tensor sizes come from the capacity, which every rank updates from the same data, so every rank's
    collectives have the same shape even when their layouts differ.
    """

    def __init__(self, packed: PackedGather, detail_rank: int = 0, bins: int = 32) -> None:
        self.packed = packed
        self.detail_rank = detail_rank
        self.bins = bins
        """Histogram buckets per key for p50/p90/p99 (0: none). 32 doubles the SUM vector at most:
        K x 32 floats, still constant in W."""
        self.reduces = 0
        self.details = 0
        self.need = 0
        """After a :meth:`reduce` that returned None: the most values any rank sent (the new capacity)."""
        self._width = -1
        self._bufs: dict[str, tuple[np.ndarray, Any, Any]] = {}

    def _buffer(self, name: str, size: int) -> tuple[np.ndarray, Any]:
        # Reused between calls, rebuilt when the capacity grows: numpy view for filling, the tensor to reduce.
        entry = self._bufs.get(name)
        if entry is None or entry[0].size != size:
            import torch

            host = np.empty(size, dtype=np.float64)
            staging = torch.from_numpy(host)
            device = self.packed.device
            sent = staging if device.type == "cpu" else staging.to(device)
            entry = self._bufs[name] = (host, staging, sent)
        host, staging, sent = entry
        return host, (staging, sent)

    def _all_reduce(self, pair: tuple[Any, Any], op: Any) -> np.ndarray:
        import torch.distributed as dist

        staging, sent = pair
        if sent is not staging:
            sent.copy_(staging)
        dist.all_reduce(sent, op=op, group=self.packed.group)
        return np.asarray(sent.cpu().numpy())  # on CPU tensors this is the staging memory itself

    def reduce(self, sig: float, values: np.ndarray, absent: np.ndarray, step: float, want_detail: bool
               ) -> Reduced | None:
        """The aggregates of this collect, or None when every rank must take the pickled fallback.

        ``sig`` is the layout's checksum, ``values`` the row over the layout, ``absent`` where it holds
        the ABSENT marker. Three all-reduces: MAX (layout check, max, min, NaNs, the detail request),
        SUM (mean, counts, the quantile histogram), MIN (the ranks holding the max, the min, a NaN).
        """
        isnan = np.isnan(values) & ~absent
        bounds = self._reduce_bounds(sig, values, absent, isnan, step, want_detail)
        if bounds is None:
            return None
        top, bottom, any_nan, detail = bounds
        present = ~absent
        sums, counts, quantiles = self._reduce_sums(values, present, isnan, bottom, top)
        top_rank, bottom_rank, nan_rank = self._reduce_holders(values, present, isnan, bottom, top)

        stats = np.empty((values.size, 5))
        stats[:, 0], stats[:, 1] = top, bottom
        with np.errstate(invalid="ignore", divide="ignore"):
            stats[:, 2] = sums / np.maximum(counts, 1)
        stats[:, 3], stats[:, 4] = top_rank, bottom_rank
        # A NaN the caller sent wins, as on the all-gather path: max/min/mean NaN, both ranks the first NaN.
        stats[any_nan, :3] = math.nan
        stats[any_nan, 3] = stats[any_nan, 4] = nan_rank[any_nan]
        none = counts == 0
        stats[none, :3] = math.nan
        stats[none, 3:] = -1
        if quantiles is not None:
            quantiles[any_nan | none] = math.nan
        per_rank = self._gather_detail(values, self.packed.capacity) if detail else None
        return Reduced(stats, counts, per_rank, quantiles)

    def _reduce_bounds(self, sig: float, values: np.ndarray, absent: np.ndarray, isnan: np.ndarray, step: float,
                       want_detail: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool] | None:
        """The MAX all-reduce: each key's max, min (as max of the negation) and whether a rank sent NaN,
        and whether any rank wants the per-rank detail; None where the layouts differ or outgrew it."""
        import torch.distributed as dist

        cap, n = self.packed.capacity, values.size
        high, buf = self._buffer("max", _HEAD + 3 * cap)
        step_hi = step if step == step else -math.inf  # a NaN step is unknown: it must not win MAX
        step_lo = -step if step == step else -math.inf
        high[:_HEAD] = (sig, -sig, n, step_hi, step_lo, 1.0 if want_detail else 0.0)
        high[_HEAD:] = -math.inf
        if n <= cap:
            hidden = absent | isnan
            high[_HEAD : _HEAD + n] = np.where(hidden, -math.inf, values)
            high[_HEAD + cap : _HEAD + cap + n] = np.where(hidden, -math.inf, -values)
            high[_HEAD + 2 * cap : _HEAD + 2 * cap + n] = isnan
        got = self._all_reduce(buf, dist.ReduceOp.MAX)
        # Equal signatures on every rank: the largest and the smallest agree. Equal layouts have equal n.
        if got[0] != -got[1] or got[2] > cap:
            self.need = int(got[2])
            return None
        self.reduces += 1
        self._check_steps(got[3], -got[4])
        top = got[_HEAD : _HEAD + n].copy()
        bottom = -got[_HEAD + cap : _HEAD + cap + n]
        any_nan = got[_HEAD + 2 * cap : _HEAD + 2 * cap + n] > 0
        return top, bottom, any_nan, bool(got[5] > 0)

    def _reduce_sums(self, values: np.ndarray, present: np.ndarray, isnan: np.ndarray, bottom: np.ndarray,
                     top: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The SUM all-reduce: each key's sum and count of ranks with a value, and its quantiles from a
        histogram over [min, max] (None without bins)."""
        import torch.distributed as dist

        cap, n, bins = self.packed.capacity, values.size, self.bins
        total, buf = self._buffer("sum", (2 + bins) * cap)
        total[:] = 0.0
        total[:n] = np.where(present & ~isnan, values, 0.0)
        total[cap : cap + n] = present
        if bins:
            where = _bucket(values, bottom, top, bins)
            counted = np.flatnonzero(present & ~isnan)
            total[2 * cap :].reshape(cap, bins)[counted, where[counted]] = 1.0
        got = self._all_reduce(buf, dist.ReduceOp.SUM)
        sums, counts = got[:n].copy(), got[cap : cap + n].copy()
        quantiles = self._quantiles(got[2 * cap :].reshape(cap, bins)[:n], counts, bottom, top) if bins else None
        return sums, counts, quantiles

    def _reduce_holders(self, values: np.ndarray, present: np.ndarray, isnan: np.ndarray, bottom: np.ndarray,
                        top: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The MIN all-reduce: the lowest rank holding each key's max, its min, and a NaN."""
        import torch.distributed as dist

        packed = self.packed
        cap, n, world = packed.capacity, values.size, packed.world
        rank = float(dist.get_rank(packed.group))
        low, buf = self._buffer("min", 3 * cap)
        low[:] = world
        low[:n] = np.where(present & (values == top), rank, world)
        low[cap : cap + n] = np.where(present & (values == bottom), rank, world)
        low[2 * cap : 2 * cap + n] = np.where(isnan, rank, world)
        got = self._all_reduce(buf, dist.ReduceOp.MIN)
        return got[:n].copy(), got[cap : cap + n].copy(), got[2 * cap : 2 * cap + n].copy()

    def _quantiles(self, hist: np.ndarray, counts: np.ndarray, bottom: np.ndarray, top: np.ndarray) -> np.ndarray:
        return bucket_quantiles(hist, counts, bottom, top, self.bins)

    def _gather_detail(self, values: np.ndarray, cap: int) -> np.ndarray | None:
        """Every rank's row to the detail rank only (one ``gather``); None on the other ranks."""
        import torch
        import torch.distributed as dist

        self.details += 1
        group, world = self.packed.group, self.packed.world
        me = dist.get_rank(group)
        send, buf = self._buffer("detail", cap)
        send[:] = math.nan
        send[: values.size] = values  # ABSENT keeps its payload: the detail rank masks it
        staging, sent = buf
        if sent is not staging:
            sent.copy_(staging)
        dst = self.detail_rank if group is None else dist.get_global_rank(group, self.detail_rank)
        out = [torch.empty_like(sent) for _ in range(world)] if me == self.detail_rank else None
        dist.gather(sent, out, dst=dst, group=group)
        if out is None:
            return None
        return np.stack([t.cpu().numpy() for t in out])[:, : values.size].copy()

    def _check_steps(self, latest: float, earliest: float) -> None:
        # Only the range is known here (no per-rank steps travel): enough to say that ranks drifted.
        if math.isfinite(latest) and math.isfinite(earliest) and latest != earliest:
            self.packed.warn_once("steps", f"ranks met in one collect() at different steps (from {earliest:.0f} "
                                   f"to {latest:.0f}): a rank called collect() more or fewer times than the "
                                   "others; the last one to call it waits for the process-group timeout")


def _bucket(values: np.ndarray, bottom: np.ndarray, top: np.ndarray, bins: int) -> np.ndarray:
    """Each value's bucket of ``bins`` over ``[bottom, top]`` (bucket 0 where the range is empty or not finite)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        where = np.floor((values - bottom) / (top - bottom) * bins)
    clipped: np.ndarray = np.nan_to_num(where, nan=0.0, posinf=bins - 1, neginf=0.0).clip(0, bins - 1)
    return clipped.astype(np.intp)


def bucket_quantiles(hist: np.ndarray, counts: np.ndarray, bottom: np.ndarray, top: np.ndarray, bins: int
                     ) -> np.ndarray:
    """Nearest-rank p50/p90/p99 per key from keys x ``bins`` histograms: the upper edge of the bucket
    holding the ``ceil(q n)``-th value (never below it, at most one bucket above it); NaN where the
    range is not finite (an infinite value leaves the buckets no width)."""
    cum = hist.cumsum(axis=1)
    out = np.empty((hist.shape[0], len(QUANTILES)))
    # A key no rank has (bottom +inf, top -inf) or with an infinite value computes inf - inf here: those
    # rows become NaN below, so numpy's warnings would only reach the training process's stderr.
    with np.errstate(invalid="ignore", over="ignore"):
        width = (top - bottom) / bins
        for j, q in enumerate(QUANTILES):
            target = np.maximum(np.ceil(q * counts), 1.0)
            bucket = (cum < target[:, None]).sum(axis=1)
            out[:, j] = np.minimum(bottom + (bucket + 1) * width, top)
    out[~np.isfinite(width) | (counts == 0)] = math.nan
    return out


def matrix_quantiles(matrix: np.ndarray, absent: np.ndarray | None, bins: int) -> np.ndarray:
    """The same bucketed quantiles from a whole ranks x keys matrix (a fallback collect of the all-reduce
    path), so that the figures do not change with the way one collect travelled."""
    present = ~np.isnan(matrix) if absent is None else ~absent & ~np.isnan(matrix)
    caller_nan = np.isnan(matrix) if absent is None else np.isnan(matrix) & ~absent
    bottom = np.where(present, matrix, math.inf).min(axis=0)
    top = np.where(present, matrix, -math.inf).max(axis=0)
    where = _bucket(matrix, bottom, top, bins)
    hist = np.zeros((matrix.shape[1], bins))
    ranks, keys = np.nonzero(present)
    np.add.at(hist, (keys, where[ranks, keys]), 1.0)
    out = bucket_quantiles(hist, present.sum(axis=0).astype(float), bottom, top, bins)
    out[caller_nan.any(axis=0)] = math.nan
    return out
