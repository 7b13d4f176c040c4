"""The one scalar coercion every path uses: the caller's metrics, verl's gather, the run-log reader;
and the one JSON cleaning (NaN and inf become null) that the run log and the event files share; and
the check of the work counts a caller tells ``Monitor.micro_batch``."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from rankmem.core.catalogue import MEMORY_PREFIX
from rankmem.errors import RankmemError


def to_float(value: Any) -> float | None:
    """``value`` as a float, or None when it is not a scalar number.

    Python and numpy numbers, bools (as 0/1) and 0-d tensors (``.item()``; on a GPU tensor that is a
    device sync, which the caller chose by passing one) are scalars; NaN and inf pass through (a
    diverged loss must reach the aggregate); strings, None, lists and multi-element arrays are not.
    """
    if isinstance(value, (bool, int, float)):
        try:
            return float(value)
        except OverflowError:  # an int beyond float64's range (10**400) is no usable figure
            return None
    item = getattr(value, "item", None)
    if item is None:
        return None
    try:
        number = item()
    except (TypeError, ValueError, RuntimeError):  # a multi-element array or tensor
        return None
    return to_float(number) if isinstance(number, (bool, int, float)) else None


_FLOAT, _STR, _RESERVED = frozenset((float,)), frozenset((str,)), "\n" + MEMORY_PREFIX
CALLER_PREFIX = "caller/"
"""Where a caller's metric named inside rankmem's ``mem/`` namespace goes instead."""


def scalar_items(metrics: Any, warn_once: Callable[[str, str], None]) -> dict[str, float]:
    """The caller's metrics as ``{key: float}``: a value that is not a number, or a ``metrics`` that is
    not a dict, is left out with one warning (raising on one rank would leave the others waiting in
    the collective)."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        warn_once("metrics-type", f"collect() takes a dict of metrics, got {type(metrics).__name__}; its values are left out")
        return {}
    # Floats under string keys outside rankmem's namespace, the common case: in C, no frame per key.
    if _FLOAT.issuperset(map(type, metrics.values())) and _STR.issuperset(map(type, metrics)) \
            and _RESERVED not in "\n" + "\n".join(metrics):
        return dict(metrics)
    out: dict[str, float] = {}
    for key, value in metrics.items():
        number = to_float(value)
        if number is None:
            warn_once(f"metric:{key}", f"metric {key!r} is not a scalar ({type(value).__name__}); left out")
            continue
        name = str(key)
        if name.startswith(MEMORY_PREFIX):
            # rankmem's own namespace: a caller's "mem/host/rss_gib" silently replaced the measured RSS.
            # Renamed by name alone, so every rank renames it alike (the collective's key sets agree).
            renamed = CALLER_PREFIX + name
            warn_once(f"reserved:{name}", f"metric {name!r} is in rankmem's namespace {MEMORY_PREFIX!r} (what it "
                                          f"measures); it is logged as {renamed!r} so the measured values stay; "
                                          "name it outside 'mem/'")
            name = renamed
        out[name] = number
    return out


def to_float_or_nan(value: Any) -> float:
    """:func:`to_float`, with NaN for anything that is not a number (a run log's ``null``)."""
    number = to_float(value)
    return math.nan if number is None else number


def json_safe(obj: Any) -> Any:
    """Non-finite floats anywhere in ``obj`` become None (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def work_numbers(tokens: Any, sequences: Any, sq_tokens: Any) -> tuple[float, float | None, float | None]:
    """``Monitor.micro_batch``'s arguments as floats, each a number (numpy's, a 0-d tensor) that is
    finite and >= 0; the optional two stay None."""
    return (_work_number("tokens", tokens), None if sequences is None else _work_number("sequences", sequences),
            None if sq_tokens is None else _work_number("sq_tokens", sq_tokens))


def _work_number(name: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RankmemError(f"micro_batch({name}=...) must be a number, got {value!r}") from None
    if not 0 <= number < math.inf or isinstance(value, bool):
        raise RankmemError(f"micro_batch({name}=...) must be a finite number >= 0, got {value!r}")
    return number
