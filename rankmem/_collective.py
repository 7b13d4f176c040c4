"""Every collective rankmem issues goes through this module.

Each function is a collective over ``group``: every rank calls it, on the same steps, in the same
order. With no initialised process group (or a world of one) none of them communicates.
"""

from __future__ import annotations

import math
import os
import socket
import time
import weakref
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from rankmem._catalogue import AGGREGATES
from rankmem._records import RankInfo, RunHeader, per_rank_lists
from rankmem._reduce import QUANTILE_NAMES, PackedReduce, Reduced, matrix_quantiles
from rankmem._scalars import to_float
from rankmem.errors import RankmemError, WarnOnce

_SIG_MASK = (1 << 52) - 1  # a float64 holds integers up to 2**53 exactly

Schema = tuple[Any, ...]
"""A rank's value layout: its sorted keys (with lengths, for lists); equal layouts pack equally."""


def dist_active(group: Any = None) -> bool:
    """True when torch.distributed is initialised and the group has more than one rank."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return bool(dist.get_world_size(group) > 1)


def rank_and_world(group: Any = None) -> tuple[int, int]:
    try:
        import torch.distributed as dist
    except ImportError:
        return 0, 1
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return int(dist.get_rank(group)), int(dist.get_world_size(group))


def global_rank() -> int:
    """This process's rank in the world (``RANK`` before the process group exists), for per-rank files."""
    rank, _ = rank_and_world(None)
    if rank == 0 and not dist_active(None):
        return int(os.environ.get("RANK", "0") or 0)
    return rank


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Pickled gather: two collectives and a pickle per rank. Only for rare, one-off exchanges."""
    if not dist_active(group):
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _check_local_device(device: str, index: int, count: int) -> str | None:
    """A warning when a device collective would run on a device that is not ``LOCAL_RANK``'s.

    NCCL ranks that gather on the same GPU fail ("Duplicate GPU") or hang: ranks that never called
    ``set_device`` all sit on device 0. ``index`` is the device the gather uses, so the check holds
    however that device was found. With one visible device per rank (``CUDA_VISIBLE_DEVICES``) every
    rank is on device 0 by design, and nothing is said.
    """
    local = os.environ.get("LOCAL_RANK")
    if local is None or count < 2 or not local.isdigit() or index == int(local) % count:
        return None
    return (
        f"LOCAL_RANK={local} but this rank gathers on {device}:{index}, its current device: call "
        f"torch.{device}.set_device(local_rank) before the first collect(), or the gathers may fail or hang"
    )


def _all_gather_single(out: Any, inp: Any, group: Any) -> None:
    """One tensor all-gather into a flat output (``all_gather_into_tensor``, renamed in torch 2.13)."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def schema_signature(schema: Schema) -> float:
    """A 52-bit checksum of the key layout, exact in a float64, equal on every rank for equal layouts."""
    text = repr(schema).encode()
    return float(((zlib.adler32(text) << 32) | zlib.crc32(text)) & _SIG_MASK)


class PackedGather:
    """Gathers one flat float64 vector per rank in a single ``all_gather_into_tensor``.

    Each rank sends ``[signature, n, step, v_0 .. v_{n-1}, NaN padding]`` of an agreed capacity. Every rank
    receives the same matrix, so every rank sees whether all signatures and lengths agree: if they do,
    the fast path is done; if not (ranks with different keys, or more values than the capacity), every
    rank falls back to one pickled gather of the layouts and values and raises the capacity for the
    next call. No rank can wait on a collective the others skip, so disagreement cannot hang.

    The first call always takes the fallback (the capacity starts at 0), which also learns the layout.
    """

    def __init__(
        self, group: Any = None, device_type: str | tuple[str, int] | None = None, device_module: Any = None
    ) -> None:
        self.group = group
        self.device_type = device_type[0] if isinstance(device_type, tuple) else device_type
        """``cuda``/``npu``/``xpu``: the device type for device-only collectives (NCCL, HCCL). The index
        is never fixed here (a pair's index is ignored): it is the current device at each gather."""
        self.device_module = device_module
        """The torch device module whose current device the tensors follow (default ``torch.<type>``)."""
        self.capacity = 0
        self.fallbacks = 0
        self._world = 0  # 0: not resolved yet; a PackedGather serves one process group
        self._backend = ""
        self._on_device = False
        self._where: tuple[str, int | None] | None = None
        self._device: Any = None
        self._warn_once = WarnOnce()
        self._last_schema: Schema | None = None
        self._last_sig = 0.0
        self._width = -1
        self._send: Any = None
        self._staging: Any = None
        self._send_np: np.ndarray = np.empty(0)
        self._out: Any = None
        self._out_np: np.ndarray | None = None  # the output as numpy, where it lives on the CPU

    def _module(self) -> tuple[str, Any] | None:
        """The device type and module of device tensors; None when there is no device to gather on."""
        if self.device_module is not None:
            return self.device_type or "cuda", self.device_module
        import torch

        if self.device_type is not None:
            module = getattr(torch, self.device_type, None)
            return None if module is None else (self.device_type, module)
        return ("cuda", torch.cuda) if torch.cuda.is_available() else None

    def resolve_device(self, backend: str) -> tuple[str, int | None]:
        """``(type, index)`` of the tensors for a group of ``backend``, read now: ``("cpu", None)`` for
        gloo and MPI (they gather CPU tensors), else the current device of the device type (NCCL, HCCL
        and XCCL gather device tensors only, on the device the rank set for itself)."""
        backend = backend.lower()
        found = None if "gloo" in backend or "mpi" in backend else self._module()
        if found is None:
            return "cpu", None
        kind, module = found
        # The first collect is a collective of the rank's own group, after its set_device: reading
        # the current device here (which initialises CUDA) is what the collective itself would do.
        return kind, int(module.current_device())

    def _follow_device(self) -> None:
        """Put the tensors on the device :meth:`resolve_device` names, moving them when it changed."""
        where = self.resolve_device(self._backend)
        if where == self._where:
            return
        import torch

        kind, index = where
        self._where, self._on_device = where, kind != "cpu"
        self._device = torch.device(kind) if index is None else torch.device(kind, index)
        self._width = -1  # the buffers are rebuilt on the new device
        if index is not None:
            found = self._module()
            count = int(found[1].device_count()) if found is not None else 0
            message = _check_local_device(kind, index, count)
            if message is not None:
                self._warn_once(f"local:{kind}:{index}", message)

    def _setup(self) -> bool:
        """Resolve the group's size once and the tensors' device at every call (the current device
        can change between collects; the check costs ~1 us next to a device collective); False when
        there is nothing to gather."""
        if self._world == 0:
            if not dist_active(self.group):
                return False
            import torch.distributed as dist

            self._world = dist.get_world_size(self.group)
            self._backend = str(dist.get_backend(self.group))
            self._follow_device()
        elif self._on_device:
            self._follow_device()
        return True

    def _buffers(self, width: int) -> None:
        # Reused between calls (reallocated only when the capacity grows): allocation is a visible
        # share of a ~100 us gloo all-gather.
        if width != self._width:
            import torch

            self._width = width
            self._send_np = np.empty(width, dtype=np.float64)
            self._staging = torch.from_numpy(self._send_np)  # shares memory with _send_np
            self._send = self._staging if self._device.type == "cpu" else self._staging.to(self._device)
            self._out = torch.empty(self._world * width, dtype=torch.float64, device=self._device)
            self._out_np = self._out.numpy() if self._device.type == "cpu" else None

    def _gathered(self, schema: Schema, values: Sequence[float], step: float) -> tuple[np.ndarray, list[int]] | int:
        """Pack, one all-gather, check. Every rank's vector as a ranks x width view of the reused output
        buffer (copy what you keep) and each rank's value count; or, when layouts differ or values outgrow
        the capacity, the count the pickled fallback must make room for (every rank returns it alike)."""
        if schema != self._last_schema:
            self._last_schema, self._last_sig = schema, schema_signature(schema)
        n, world, width = len(values), self._world, self.capacity + _HEAD
        self._buffers(width)
        send = self._send_np
        send[0], send[1], send[2] = self._last_sig, n, step
        if n <= self.capacity:
            send[_HEAD : _HEAD + n] = values
            if n < self.capacity:
                send[_HEAD + n :] = math.nan
        else:
            send[_HEAD:] = math.nan
        if self._device.type != "cpu":
            self._send.copy_(self._staging)  # host-to-device
        _all_gather_single(self._out, self._send, self.group)
        out = self._out_np if self._out_np is not None else self._out.cpu().numpy()  # a device-to-host sync on NCCL
        block = out.reshape(world, width)
        # The headers as Python numbers: a few per rank, cheaper to check than through numpy calls.
        head = block[:, :_HEAD].tolist()
        lengths = [int(h[1]) for h in head]
        self._check_steps([h[2] for h in head])
        sig = head[0][0]
        # Equal layouts may still carry different numbers of values (per-rank list lengths inside
        # the payload); all that must hold is that every rank's values fit.
        if all(h[0] == sig for h in head) and max(lengths) <= self.capacity:
            return block, lengths
        return max(lengths)

    def gather(self, schema: Schema, values: Sequence[float], step: float = math.nan
               ) -> tuple[list[Schema], list[np.ndarray]]:
        """Per rank, its layout and its values. A collective: every rank of the group calls it.

        ``step`` travels in the header: ranks that meet at different steps are named in a warning.
        """
        if not self._setup():
            return [schema], [np.asarray(values, dtype=np.float64)]
        got = self._gathered(schema, values, step)
        if isinstance(got, int):
            return self.fallback(schema, values, got)
        block, lengths = got
        rows = block.copy()
        return [schema] * len(lengths), [rows[r, _HEAD : _HEAD + n] for r, n in enumerate(lengths)]

    def gather_matrix(self, schema: Schema, values: Sequence[float], step: float = math.nan
                      ) -> np.ndarray | tuple[list[Schema], list[np.ndarray]]:
        """:meth:`gather`, with the steady state of a :class:`Monitor` made cheap: when every rank sent
        this layout and as many values, one ranks x values matrix (a copy); otherwise what
        :meth:`gather` returns. A collective, like :meth:`gather`."""
        if not self._setup():
            return np.asarray(values, dtype=np.float64).reshape(1, -1)
        got = self._gathered(schema, values, step)
        if isinstance(got, int):
            return self.fallback(schema, values, got)
        block, lengths = got
        n = len(values)
        if all(length == n for length in lengths):
            return block[:, _HEAD : _HEAD + n].copy()
        rows = block.copy()
        return [schema] * len(lengths), [rows[r, _HEAD : _HEAD + k] for r, k in enumerate(lengths)]

    def fallback(self, schema: Schema, values: Sequence[float], need: int
                 ) -> tuple[list[Schema], list[np.ndarray]]:
        """The pickled gather every rank takes together when layouts disagree or values outgrow the
        capacity; ``need`` (the most values any rank sent, known alike on every rank) is the new one."""
        self.fallbacks += 1
        gathered = all_gather_objects((schema, list(map(float, values))), self.group)
        self.capacity = need
        return [g[0] for g in gathered], [np.asarray(g[1], dtype=np.float64) for g in gathered]

    def _check_steps(self, steps: list[float]) -> None:
        """Ranks meeting in one gather at different steps: one of them called collect() more (or fewer)
        times than the others and met its peers' next collect instead of its own. Every rank sees the
        same steps, so every rank says the same thing."""
        known = [s for s in steps if s == s]  # NaN: no step given
        if not known or all(s == known[0] for s in known):
            return
        at: dict[int, list[int]] = {}
        for r, s in enumerate(steps):
            if s == s:
                at.setdefault(int(s), []).append(r)
        detail = "; ".join(f"rank(s) {ranks} at step {s}" for s, ranks in sorted(at.items()))
        self._warn_once("steps", f"ranks met in one collect() at different steps ({detail}): a rank called collect() "
                        "more or fewer times than the others; the last one to call it waits for the process-group "
                        "timeout")


_HEAD = 3
"""The header of each rank's packed vector: layout checksum, value count, the caller's step."""


_SUFFIXES = tuple("/" + a for a in AGGREGATES)
_names_cache: dict[tuple[str, ...], list[str]] = {}


def _aggregate_names(keys: Sequence[str]) -> list[str]:
    key_tuple = tuple(keys)
    names = _names_cache.get(key_tuple)
    if names is None:
        if len(_names_cache) > 64:  # layouts rarely change; keep the cache from growing without bound
            _names_cache.clear()
        names = _names_cache[key_tuple] = [k + suffix for k in key_tuple for suffix in _SUFFIXES]
    return names


_quantile_cache: dict[tuple[str, ...], list[str]] = {}


def _quantile_names(keys: Sequence[str]) -> list[str]:
    """``K/p50``, ``K/p90``, ``K/p99`` per key (the all-reduce path only), cached as the aggregate names are."""
    key_tuple = tuple(keys)
    names = _quantile_cache.get(key_tuple)
    if names is None:
        if len(_quantile_cache) > 64:
            _quantile_cache.clear()
        names = _quantile_cache[key_tuple] = [f"{k}/{q}" for k in key_tuple for q in QUANTILE_NAMES]
    return names


def aggregate(keys: Sequence[str], matrix: np.ndarray, nan_is_absent: bool = False,
              absent: np.ndarray | None = None) -> dict[str, float]:
    """``K/max``, ``K/min``, ``K/mean``, ``K/max_rank``, ``K/min_rank`` per column of a ranks x keys matrix.

    A NaN the caller sent (a diverged loss) propagates to max, min and mean, and both ranks name the
    first rank holding it, so a bad rank cannot hide behind a healthy mean. ``absent`` (a boolean
    matrix) marks ranks without a key: they are left out; a key no rank has gives NaN (ranks -1).
    ``nan_is_absent=True`` takes every NaN as absent (a run log's ``null``). The hot path, every rank
    with every key, is five numpy reductions and one dict build from cached names.
    """
    if nan_is_absent:
        absent = np.isnan(matrix)
    # One (keys x 5) block filled in place, so that ravel() needs no copy before tolist().
    stats = np.empty((matrix.shape[1], len(_SUFFIXES)))
    if absent is None or not absent.any():
        matrix.max(axis=0, out=stats[:, 0])
        matrix.min(axis=0, out=stats[:, 1])
        matrix.sum(axis=0, out=stats[:, 2])
        stats[:, 2] /= max(matrix.shape[0], 1)
        stats[:, 3] = matrix.argmax(axis=0)
        stats[:, 4] = matrix.argmin(axis=0)
    else:
        present = ~absent
        counts = present.sum(axis=0)
        none = counts == 0
        high = np.where(present, matrix, -math.inf)
        low = np.where(present, matrix, math.inf)
        with np.errstate(invalid="ignore", divide="ignore"):
            stats[:, 2] = np.where(present, matrix, 0.0).sum(axis=0) / np.maximum(counts, 1)
        stats[:, 0] = high.max(axis=0)
        stats[:, 1] = low.min(axis=0)
        stats[:, 3] = high.argmax(axis=0)
        stats[:, 4] = low.argmin(axis=0)
        stats[none, :3] = math.nan
        stats[none, 3:] = -1
    return dict(zip(_aggregate_names(keys), stats.ravel().tolist(), strict=True))


# A rank without a key sends this NaN: its payload tells "absent" from a NaN the caller sent. Gathers
# copy bytes (gloo, NCCL, pickled floats), so the payload survives.
ABSENT_BITS = np.uint64(0x7FF8_0000_DEAD_0001)
ABSENT = float(np.array([ABSENT_BITS]).view(np.float64)[0])


def absent_mask(matrix: np.ndarray) -> np.ndarray:
    return np.asarray(matrix.view(np.uint64) == ABSENT_BITS)


def union_matrix(schemas: Sequence[Sequence[str]], rows: Sequence[np.ndarray]) -> tuple[list[str], np.ndarray]:
    """Align per-rank ``(keys, values)`` on the sorted union of keys, :data:`ABSENT` where a rank lacks one."""
    keys = sorted(set().union(*schemas))
    col = {k: j for j, k in enumerate(keys)}
    matrix = np.full((len(rows), len(keys)), ABSENT)
    for r, (schema, row) in enumerate(zip(schemas, rows, strict=True)):
        for k, v in zip(schema, row, strict=True):
            matrix[r, col[k]] = v
    return keys, matrix


@dataclass(slots=True)
class Gathered:
    """One collect's aggregates, the same on every rank, and (when this collect carries it) the per-rank detail."""

    keys: Sequence[str]
    """Sorted per-rank keys (the union over ranks when they disagreed)."""
    matrix: np.ndarray | None
    """ranks x keys, float64; NaN where a rank lacked a key (only when ``mixed``) or sent NaN. None on
    purpose where this collect carries no per-rank detail: past :attr:`Exchange.reduce_above` ranks the
    detail reaches only the detail rank, every ``detail_every`` collects (see :mod:`rankmem._reduce`)."""
    aggregated: dict[str, float]
    """``K/max``, ``K/min``, ``K/mean``, ``K/max_rank``, ``K/min_rank`` for every key."""
    mixed: bool
    """True when ranks sent different keys (each key aggregated over the ranks that have it)."""

    def columns(self) -> dict[str, list[float | None]]:
        """Per key, each rank's value (``None`` where absent): the run log's per-rank part; empty when
        this collect carries no detail (the run log line then holds the aggregates only)."""
        if self.matrix is None:
            return {}
        return per_rank_lists(self.keys, self.matrix)


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "")
    try:
        return int(text) if text else default
    except ValueError:
        raise RankmemError(f"{name}={text!r}: expected an integer") from None


REDUCE_ABOVE = 128
"""Default crossover world size: above it the aggregates travel by all-reduce (bench/RESULTS.md, "Scale")."""
DETAIL_EVERY = 100
"""Default cadence of the per-rank detail on the all-reduce path, in collects."""


class Exchange:
    """The one collective of a collect: pack, gather, detect mixed keys, fall back, aggregate.

    :meth:`gather_aggregate` is a collective over ``group``: every rank calls it, on the same steps.
    With no process group (or a world of one) nothing is communicated.

    Ranks that disagree on keys take one pickled gather together; from then on every rank packs the
    agreed union of keys (:data:`ABSENT` where it lacks one), so keys that come and go per rank stay on
    the one-tensor path and only a key never seen before costs a pickled gather. The union is capped at
    :data:`MAX_LAYOUT` keys (beyond it, it restarts from the current step's keys), and the mixed-keys
    warning is given for at most :data:`MAX_KEY_WARNINGS` different key sets.

    Worlds larger than ``reduce_above`` ranks (default :data:`REDUCE_ABOVE`, or ``RANKMEM_REDUCE_ABOVE``)
    take :class:`rankmem._reduce.PackedReduce` instead: three all-reduces whose size does not grow with
    the world, and the per-rank matrix gathered to ``detail_rank`` only, every ``detail_every`` collects
    (``RANKMEM_DETAIL_EVERY``) or when any rank passes ``detail=True``; on the other collects
    :attr:`Gathered.matrix` is None. That path adds ``K/p50``, ``K/p90``, ``K/p99`` across ranks, exact to
    one of ``quantile_bins`` buckets over ``[K/min, K/max]`` (0: none). Every rank must be given the same knobs (torchrun passes the same
    environment to all).
    """

    MAX_LAYOUT = 4096
    MAX_KEY_WARNINGS = 8

    def __init__(self, group: Any = None, device_type: str | None = None, device_module: Any = None, *,
                 reduce_above: int | None = None, detail_every: int | None = None, detail_rank: int = 0,
                 quantile_bins: int = 32) -> None:
        # The gather's device is resolved at the first collect, from the backend's current device.
        self.packed = PackedGather(group, device_type, device_module=device_module)
        self.reduce = PackedReduce(self.packed, detail_rank, quantile_bins)
        self.reduce_above = reduce_above if reduce_above is not None else _env_int("RANKMEM_REDUCE_ABOVE", REDUCE_ABOVE)
        self.detail_every = max(1, detail_every if detail_every is not None
                                else _env_int("RANKMEM_DETAIL_EVERY", DETAIL_EVERY))
        self._collects = 0
        self._layout: tuple[str, ...] = ()
        self._layout_set: frozenset[str] = frozenset()
        self._warned: set[tuple[str, ...]] = set()
        self._warn_once = WarnOnce()

    def gather_aggregate(self, values: Mapping[str, float], step: int | None = None, detail: bool = False
                         ) -> Gathered:
        """``detail=True`` on any rank makes this collect carry the per-rank matrix on the reduce path
        (a rank that just recorded an event); the all-gather path always carries it."""
        if self._layout_set and self._layout_set.issuperset(values):
            schema = self._layout
            row = [values.get(k, ABSENT) for k in schema]
        else:
            schema = tuple(sorted(values))
            row = [values[k] for k in schema]
        step_f = math.nan if step is None else float(step)
        packed = self.packed
        if (packed._world or (packed._setup() and packed._world)) > self.reduce_above and packed._setup():
            # The same collect count on every rank: every rank asks for the detail on the same collects.
            want = detail or self._collects % self.detail_every == 0
            self._collects += 1
            if schema != packed._last_schema:
                packed._last_schema, packed._last_sig = schema, schema_signature(schema)
            array = np.asarray(row, dtype=np.float64)
            reduced = self.reduce.reduce(packed._last_sig, array, absent_mask(array), step_f, want)
            if reduced is not None:
                return self._from_reduced(schema, reduced)
            schemas, rows = self.packed.fallback(schema, row, self.reduce.need)
            return self._from_rows(schema, schemas, rows, self.reduce.bins)
        got = self.packed.gather_matrix(schema, row, step_f)
        if isinstance(got, np.ndarray):  # every rank sent this layout: the steady state
            return self._aggregate_matrix(schema, got)
        return self._from_rows(schema, *got)

    def _from_reduced(self, schema: tuple[str, ...], reduced: Reduced) -> Gathered:
        keys: Sequence[str] = schema
        stats, counts, matrix, quantiles = reduced.stats, reduced.counts, reduced.detail, reduced.quantiles
        world = self.packed._world
        mixed = bool(self._layout) and bool((counts < world).any())
        if mixed:
            kept = counts > 0  # keys of the agreed layout that no rank has this time
            if not kept.all():
                keys = [k for k, keep in zip(keys, kept.tolist(), strict=True) if keep]
                stats, counts = stats[kept], counts[kept]
                quantiles = None if quantiles is None else quantiles[kept]
                matrix = None if matrix is None else matrix[:, kept]
            mixed = bool((counts < world).any())  # every rank dropped the same keys: they agree again
            if mixed:
                self._warn_mixed(keys, counts < world)
        if matrix is not None:
            matrix[absent_mask(matrix)] = math.nan  # downstream (run log, leak watch) reads NaN as absent
        aggregated = dict(zip(_aggregate_names(keys), stats.ravel().tolist(), strict=True))
        if quantiles is not None:
            aggregated.update(zip(_quantile_names(keys), quantiles.ravel().tolist(), strict=True))
        return Gathered(keys, matrix, aggregated, mixed)

    def _from_rows(self, schema: tuple[str, ...], schemas: Sequence[Schema], rows: Sequence[np.ndarray],
                   bins: int = 0) -> Gathered:
        """The aggregates from every rank's values; with ``bins``, the all-reduce path's quantiles too."""
        gathered = self._aggregate_rows(schema, schemas, rows)
        if bins and gathered.matrix is not None:
            absent = np.isnan(gathered.matrix) if gathered.mixed else None  # absent is NaN by now
            quantiles = matrix_quantiles(gathered.matrix, absent, bins)
            if absent is not None:  # NaN cells of a mixed matrix may be a caller's NaN: aggregate knows
                quantiles[np.isnan([gathered.aggregated[k + "/max"] for k in gathered.keys])] = math.nan
            gathered.aggregated.update(zip(_quantile_names(gathered.keys), quantiles.ravel().tolist(), strict=True))
        return gathered

    def _aggregate_rows(self, schema: tuple[str, ...], schemas: Sequence[Schema], rows: Sequence[np.ndarray]
                        ) -> Gathered:
        if all(s == schema for s in schemas):
            return self._aggregate_matrix(schema, np.vstack(rows) if rows else np.zeros((0, 0)))
        keys, matrix = union_matrix(schemas, rows)
        if len(keys) > self.MAX_LAYOUT:  # keys that never repeat: do not carry them forever
            self._layout, self._layout_set = (), frozenset()
        else:
            self._layout, self._layout_set = tuple(keys), frozenset(keys)
            # Every rank packs the whole union from now on: make room for it in the same step.
            self.packed.capacity = max(self.packed.capacity, len(keys))
        return self._aggregate_matrix(keys, matrix)

    def _aggregate_matrix(self, keys: Sequence[str], matrix: np.ndarray) -> Gathered:
        """The aggregates of a ranks x keys matrix; the keys of the agreed layout that some rank lacks
        (:data:`ABSENT`) are aggregated over the ranks that have them."""
        absent = absent_mask(matrix) if self._layout else None
        if absent is None or not absent.any():
            return Gathered(keys, matrix, aggregate(keys, matrix), mixed=False)
        kept = np.asarray(~absent.all(axis=0))  # keys of the agreed layout that no rank has this time
        if not kept.all():
            keys = [k for k, keep in zip(keys, list(kept), strict=True) if keep]
            matrix, absent = matrix[:, kept], absent[:, kept]
            if not absent.any():  # every rank dropped the same keys: they agree again
                return Gathered(keys, matrix, aggregate(keys, matrix), mixed=False)
        self._warn_mixed(keys, np.asarray(absent.any(axis=0)))
        matrix[absent] = math.nan  # downstream (run log, leak watch) reads NaN as absent
        return Gathered(keys, matrix, aggregate(keys, matrix, absent=absent), mixed=True)

    def _warn_mixed(self, keys: Sequence[str], some_absent: np.ndarray) -> None:
        differing = tuple(k for k, some in zip(keys, list(some_absent), strict=True) if some)
        if differing in self._warned or len(self._warned) > self.MAX_KEY_WARNINGS:
            return
        self._warned.add(differing)
        if len(self._warned) > self.MAX_KEY_WARNINGS:
            self._warn_once("keys-many", f"ranks keep reporting different key sets; "
                            f"no more than {self.MAX_KEY_WARNINGS} are reported")
            return
        self._warn_once("keys:" + ",".join(differing),
                        f"ranks reported different keys {list(differing)}; each is aggregated over the ranks that have it")


def run_header(group: Any, log_rank: int, config: dict[str, Any], device: str, peak_scope: str) -> RunHeader:
    """Who every rank is, once per run, at the first collect (pickled: two collectives, not worth a
    packed layout). A collective; a ``log_rank`` outside the group raises on every rank alike."""
    rank, world = rank_and_world(group)
    if log_rank >= world:  # every rank knows the world size: all raise together
        raise RankmemError(f"log_rank={log_rank} but the group has {world} rank(s): use 0..{world - 1}")
    me = RankInfo(rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", "0")), host=socket.gethostname(),
                  pid=os.getpid(), device=device, peak_rss_scope=peak_scope)
    ranks = [RankInfo(**info) for info in all_gather_objects(asdict(me), group)]
    return RunHeader(world_size=world, ranks=ranks, config=config, started=time.time())


_NUMBER = (int, float)


def _as_numbers(value: Any) -> tuple[str, list[float]] | None:
    """``("s", [v])`` for a scalar, ``("l", [...])`` for a flat list of numbers, None otherwise."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()  # tensors and numpy values; a 0-d one gives a scalar
    if not isinstance(value, (bool, list, tuple)) and (number := to_float(value)) is not None:
        return "s", [number]  # a bool is verl's object, not a number: it keeps its type
    if isinstance(value, (list, tuple)) and all(isinstance(v, _NUMBER) and not isinstance(v, bool) for v in value):
        return "l", [float(v) for v in value]
    return None


class VerlDictGather:
    """The gather behind :func:`allgather_dict_into_dict`; keep one per call site (it learns a capacity).

    The layout checksum covers the keys and their kinds (scalar, list, object) only; list lengths
    travel inside the payload, so per-rank micro-batch counts that differ (verl's dynamic batch size)
    stay on the one-tensor fast path.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self._gather = PackedGather(group)

    def __call__(self, data: Mapping[str, Any]) -> dict[str, list[Any]]:
        if not isinstance(data, Mapping):
            raise TypeError(f"allgather_dict_into_dict expects a dict, got {type(data).__name__}")
        layout: list[tuple[str, str]] = []
        list_lengths: list[float] = []
        values: list[float] = []
        objects: dict[str, Any] = {}
        for key, value in data.items():  # insertion order, as verl's result keeps it
            numbers = _as_numbers(value)
            if numbers is None:
                layout.append((key, "o"))
                objects[key] = value
            else:
                layout.append((key, numbers[0]))
                if numbers[0] == "l":
                    list_lengths.append(len(numbers[1]))
                values.extend(numbers[1])
        layouts, rows = self._gather.gather(tuple(layout), list_lengths + values)
        # Every rank sees every layout, so all take the pickled path together or none does.
        gathered_objects: list[dict[str, Any]] = [objects]
        if any(kind == "o" for lay in layouts for _, kind in lay):
            gathered_objects = all_gather_objects(objects, self.group)
        out: dict[str, list[Any]] = {}
        for rank, (rank_layout, row) in enumerate(zip(layouts, rows, strict=True)):
            n_lists = sum(1 for _, kind in rank_layout if kind == "l")
            lengths = iter(int(x) for x in row[:n_lists])
            pos = n_lists
            for key, kind in rank_layout:
                item: Any
                if kind == "o":
                    item = gathered_objects[rank][key]
                else:
                    length = 1 if kind == "s" else next(lengths)
                    chunk = row[pos : pos + length].tolist()  # float64: integers exact up to 2**53
                    pos += length
                    item = chunk[0] if kind == "s" else chunk
                out.setdefault(key, []).append(item)
        return out


# One gather per process group, so that its learned capacity is shared by every call on that group
# and dies with the group (a re-initialised world starts afresh on every rank alike).
_gathers: weakref.WeakKeyDictionary[Any, VerlDictGather] = weakref.WeakKeyDictionary()


def allgather_dict_into_dict(data: Mapping[str, Any], group: Any = None) -> dict[str, list[Any]]:
    """Drop-in for ``verl.utils.torch_functional.allgather_dict_into_dict``: a collective over ``group``.

    Returns, per key, each rank's value in rank order (a scalar per rank, or that rank's list; numbers
    come back as floats). Numbers travel in one ``all_gather_into_tensor``; values that are not numbers
    (verl's ``Metric`` objects) make every rank add one pickled gather. Without a process group it
    returns ``[value]``.
    """
    if not dist_active(group):
        return VerlDictGather(group)(data)
    import torch.distributed as dist

    key = group if group is not None else dist.group.WORLD
    gather = _gathers.get(key)
    if gather is None:
        gather = _gathers[key] = VerlDictGather(group)
    return gather(data)
