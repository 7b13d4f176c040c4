"""Every collective rankmem issues goes through this module.

Each function is a collective over ``group``: every rank calls it, on the same steps, in the same
order. With no initialised process group (or a world of one) none of them communicates.
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

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


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Pickled gather: two collectives and a pickle per rank. Only for rare, one-off exchanges."""
    if not dist_active(group):
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


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

    Each rank sends ``[signature, n, v_0 .. v_{n-1}, NaN padding]`` of an agreed capacity. Every rank
    receives the same matrix, so every rank sees whether all signatures and lengths agree: if they do,
    the fast path is done; if not (ranks with different keys, or more values than the capacity), every
    rank falls back to one pickled gather of the layouts and values and raises the capacity for the
    next call. No rank can wait on a collective the others skip, so disagreement cannot hang.

    The first call always takes the fallback (the capacity starts at 0), which also learns the layout.
    """

    def __init__(self, group: Any = None, device: tuple[str, int] | None = None) -> None:
        self.group = group
        self.device_hint = device
        """``(device_type, index)`` of the monitor's backend, for device-only collectives (NCCL, HCCL)."""
        self.capacity = 0
        self.fallbacks = 0
        self._device: Any = None
        self._last_schema: Schema | None = None
        self._last_sig = 0.0

    def _tensor_device(self) -> Any:
        if self._device is None:
            import torch
            import torch.distributed as dist

            backend = str(dist.get_backend(self.group)).lower()
            # gloo (and MPI) gather CPU tensors; NCCL, HCCL and XCCL gather device tensors only.
            if "gloo" in backend or "mpi" in backend:
                self._device = torch.device("cpu")
            elif self.device_hint is not None:
                self._device = torch.device(*self.device_hint)
            elif torch.cuda.is_available():
                self._device = torch.device("cuda", torch.cuda.current_device())
            else:
                self._device = torch.device("cpu")
        return self._device

    def gather(self, schema: Schema, values: Sequence[float]) -> tuple[list[Schema], list[np.ndarray]]:
        """Per rank, its layout and its values. A collective: every rank of the group calls it."""
        if not dist_active(self.group):
            return [schema], [np.asarray(values, dtype=np.float64)]
        import torch
        import torch.distributed as dist

        if schema != self._last_schema:
            self._last_schema, self._last_sig = schema, schema_signature(schema)
        n = len(values)
        world = dist.get_world_size(self.group)
        width = self.capacity + 2
        send = np.full(width, math.nan, dtype=np.float64)
        send[0], send[1] = self._last_sig, n
        if n <= self.capacity:
            send[2 : 2 + n] = values
        device = self._tensor_device()
        inp = torch.from_numpy(send).to(device)
        out = torch.empty(world * width, dtype=torch.float64, device=device)
        _all_gather_single(out, inp, self.group)
        rows = out.cpu().numpy().reshape(world, width)  # a device-to-host sync on NCCL
        sigs, lengths = rows[:, 0], rows[:, 1]
        if (sigs == sigs[0]).all() and (lengths == lengths[0]).all() and n <= self.capacity:
            return [schema] * world, list(rows[:, 2 : 2 + n])
        self.fallbacks += 1
        gathered = all_gather_objects((schema, list(map(float, values))), self.group)
        self.capacity = int(lengths.max())
        return [g[0] for g in gathered], [np.asarray(g[1], dtype=np.float64) for g in gathered]


_SUFFIXES = ("/max", "/min", "/mean", "/max_rank")
_names_cache: dict[tuple[str, ...], list[str]] = {}


def _aggregate_names(keys: Sequence[str]) -> list[str]:
    key_tuple = tuple(keys)
    names = _names_cache.get(key_tuple)
    if names is None:
        if len(_names_cache) > 64:  # layouts rarely change; keep the cache from growing without bound
            _names_cache.clear()
        names = _names_cache[key_tuple] = [k + suffix for k in key_tuple for suffix in _SUFFIXES]
    return names


def aggregate(keys: Sequence[str], matrix: np.ndarray) -> dict[str, float]:
    """``K/max``, ``K/min``, ``K/mean``, ``K/max_rank`` per column of a ranks x keys matrix.

    NaN marks a rank without the value; it is left out. A key no rank has gives NaN (max_rank -1).
    On the hot path (no NaN) this is four numpy reductions and one dict build from cached names.
    """
    if matrix.size and not np.isnan(matrix).any():
        stats = np.stack([matrix.max(axis=0), matrix.min(axis=0), matrix.mean(axis=0), matrix.argmax(axis=0)])
    else:
        present = ~np.isnan(matrix)
        counts = present.sum(axis=0)
        sums = np.where(present, matrix, 0.0).sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            means = np.where(counts > 0, sums / np.maximum(counts, 1), math.nan)
        argmax = np.where(present, matrix, -math.inf).argmax(axis=0)
        stats = np.stack([
            np.fmax.reduce(matrix, axis=0),
            np.fmin.reduce(matrix, axis=0),
            means,
            np.where(counts > 0, argmax, -1),
        ])
    return dict(zip(_aggregate_names(keys), stats.T.ravel().tolist(), strict=True))


def union_matrix(schemas: Sequence[Sequence[str]], rows: Sequence[np.ndarray]) -> tuple[list[str], np.ndarray]:
    """Align per-rank ``(keys, values)`` on the sorted union of keys, NaN where a rank lacks one."""
    keys = sorted(set().union(*schemas))
    col = {k: j for j, k in enumerate(keys)}
    matrix = np.full((len(rows), len(keys)), math.nan)
    for r, (schema, row) in enumerate(zip(schemas, rows, strict=True)):
        for k, v in zip(schema, row, strict=True):
            matrix[r, col[k]] = v
    return keys, matrix


def _flatten(data: Mapping[str, Any]) -> tuple[tuple[tuple[str, int], ...], list[float]]:
    layout = []
    flat: list[float] = []
    for key in sorted(data):
        value = data[key]
        if hasattr(value, "tolist"):  # tensors and numpy arrays
            value = value.tolist()
        items = value if isinstance(value, (list, tuple)) else [value]
        layout.append((key, len(items)))
        flat.extend(float(x) for x in items)
    return tuple(layout), flat


class DictGather:
    """A reusable drop-in for verl's ``allgather_dict_into_dict``: no pickling in steady state.

    ``data`` maps keys to a scalar or a list of scalars; the result maps each key to the
    concatenation, in rank order, of every rank's values (one element per rank for scalars).
    Keep one instance per call site so the agreed capacity persists between calls.
    """

    def __init__(self, group: Any = None) -> None:
        self._gather = PackedGather(group)
        self._warned = False

    def __call__(self, data: Mapping[str, Any]) -> dict[str, list[float]]:
        layout, flat = _flatten(data)
        layouts, rows = self._gather.gather(layout, flat)
        out: dict[str, list[float]] = {}
        for rank_layout, row in zip(layouts, rows, strict=True):
            pos = 0
            for key, length in rank_layout:
                out.setdefault(key, []).extend(row[pos : pos + length].tolist())
                pos += length
        if not self._warned and any(set(lay) != set(layouts[0]) for lay in layouts):
            self._warned = True
            keysets = [{k for k, _ in lay} for lay in layouts]
            differing = sorted(set().union(*keysets) - set.intersection(*keysets))
            if differing:
                warnings.warn(f"rankmem: ranks gathered different keys: {differing}", RuntimeWarning, stacklevel=2)
        return out


_default_dict_gathers: dict[int, DictGather] = {}


def allgather_dict_into_dict(data: Mapping[str, Any], group: Any = None) -> dict[str, list[float]]:
    """verl-compatible: every rank's values of each key, in rank order, in one tensor collective."""
    gather = _default_dict_gathers.get(id(group))
    if gather is None:
        gather = _default_dict_gathers[id(group)] = DictGather(group)
    return gather(data)
