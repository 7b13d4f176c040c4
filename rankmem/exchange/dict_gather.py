"""verl's ``allgather_dict_into_dict`` as one tensor collective: the drop-in for verl's pickled gather.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

from rankmem.core.scalars import to_float
from rankmem.exchange.dist import all_gather_objects, dist_active


def _as_numbers(value: Any) -> tuple[str, list[float]] | None:
    """``("s", [v])`` for a scalar, ``("l", [...])`` for a flat list of numbers, None otherwise."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()  # tensors and numpy values; a 0-d one gives a scalar
    if not isinstance(value, (bool, list, tuple)) and (number := to_float(value)) is not None:
        return "s", [number]  # a bool is verl's object, not a number: it keeps its type
    if isinstance(value, (list, tuple)) and all(isinstance(v, _NUMBER) and not isinstance(v, bool) for v in value):
        try:
            return "l", [float(v) for v in value]
        except OverflowError:  # an int beyond float64's range: the object goes pickled, as verl's does
            return None
    return None


_NUMBER = (int, float)


def _encode(data: Mapping[str, Any]) -> tuple[tuple[tuple[str, str], ...], list[float], dict[str, Any]]:
    """The layout (key, kind) in insertion order, the payload (list lengths, then the numbers) and the
    objects. Every step's metrics dict passes here: plain floats and lists of plain floats, by far the
    common values, skip the general test."""
    layout: list[tuple[str, str]] = []
    list_lengths: list[float] = []
    values: list[float] = []
    objects: dict[str, Any] = {}
    for key, value in data.items():  # insertion order, as verl's result keeps it
        kind = type(value)
        if kind is float:
            layout.append((key, "s"))
            values.append(value)
            continue
        if kind is list and all(type(v) is float for v in value):
            layout.append((key, "l"))
            list_lengths.append(len(value))
            values.extend(value)
            continue
        numbers = _as_numbers(value)
        if numbers is None:
            layout.append((key, "o"))
            objects[key] = value
        else:
            layout.append((key, numbers[0]))
            if numbers[0] == "l":
                list_lengths.append(len(numbers[1]))
            values.extend(numbers[1])
    return tuple(layout), list_lengths + values, objects


class VerlDictGather:
    """The gather behind :func:`allgather_dict_into_dict`; keep one per call site (it learns a capacity).

    The layout checksum covers the keys and their kinds (scalar, list, object) only; list lengths
    travel inside the payload, so per-rank micro-batch counts that differ (verl's dynamic batch size)
    stay on the one-tensor fast path.
    """

    def __init__(self, group: Any = None) -> None:
        from rankmem.exchange.packed import PackedGather  # numpy: not loaded by `import rankmem`

        self.group = group
        self._gather = PackedGather(group)

    def __call__(self, data: Mapping[str, Any]) -> dict[str, list[Any]]:
        if not isinstance(data, Mapping):
            raise TypeError(f"allgather_dict_into_dict expects a dict, got {type(data).__name__}")
        layout, payload, objects = _encode(data)
        layouts, rows = self._gather.gather(layout, payload)
        # Every rank sees every layout, so all take the pickled path together or none does.
        gathered_objects: list[dict[str, Any]] = [objects]
        if any(kind == "o" for lay in layouts for _, kind in lay):
            gathered_objects = all_gather_objects(objects, self.group)
        out: dict[str, list[Any]] = {}
        for rank, (rank_layout, row) in enumerate(zip(layouts, rows, strict=True)):
            n_lists = sum(1 for _, kind in rank_layout if kind == "l")  # their lengths lead the payload
            numbers = row.tolist()  # once per rank: float64 gives Python floats, integers exact up to 2**53
            pos = n_lists
            lists = 0
            for key, kind in rank_layout:
                item: Any
                if kind == "s":
                    item = numbers[pos]
                    pos += 1
                elif kind == "l":
                    length = int(numbers[lists])
                    lists += 1
                    item = numbers[pos : pos + length]
                    pos += length
                else:
                    item = gathered_objects[rank][key]
                entry = out.get(key)
                if entry is None:
                    out[key] = [item]
                else:
                    entry.append(item)
        return out


# One gather per process group, so that its learned capacity is shared by every call on that group
# and dies with the group (a re-initialised world starts afresh on every rank alike).
_gathers: weakref.WeakKeyDictionary[Any, VerlDictGather] = weakref.WeakKeyDictionary()


def allgather_dict_into_dict(data: Mapping[str, Any], group: Any = None) -> dict[str, list[Any]]:
    """Drop-in for ``verl.utils.torch_functional.allgather_dict_into_dict``: a collective over ``group``.

    Returns, per key, each rank's value in rank order (numbers come back as floats). Numbers travel in one
    ``all_gather_into_tensor``; values that are not numbers make every rank add one pickled gather. Without
    a process group it returns ``[value]``.
    """
    if not dist_active(group):
        return VerlDictGather(group)(data)
    import torch.distributed as dist

    key = group if group is not None else dist.group.WORLD
    gather = _gathers.get(key)
    if gather is None:
        gather = _gathers[key] = VerlDictGather(group)
    return gather(data)
