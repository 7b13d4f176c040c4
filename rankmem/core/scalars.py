"""The one scalar coercion every path uses: the caller's metrics, verl's gather, the run-log reader;
and the one JSON cleaning (NaN and inf become null) that the run log and the event files share; and
the check of the work counts a caller tells ``Monitor.micro_batch``."""

from __future__ import annotations

import enum
import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from rankmem.core.catalogue import MEMORY_PREFIX
from rankmem.core.warnings import warn
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
        warn_once("metrics-type",
                  f"collect() takes a dict of metrics, got {type(metrics).__name__}; its values are left out")
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


UNENCODABLE = "<not encodable: {}>"
"""What the run log's header holds in place of a config value JSON cannot hold (named by its type)."""
CYCLE = "<cycle>"
"""What it holds in place of a container that contains itself."""
CONFIG_MAX_BYTES = 4 << 20  # of a run_config's JSON: the header line is read up to 16 MiB, ranks included


def plain_config(config: Any) -> Any:
    """The caller's ``run_config`` as plain JSON data, once, at the Monitor's construction: keys become
    strings (numpy's and Enum's, tuples), numpy scalars numbers, tuples and sets lists, paths strings,
    non-finite floats None; a cycle becomes :data:`CYCLE` and anything else :data:`UNENCODABLE`, with one
    warning naming the first. Keys equal as text get their type's name; where the whole passes
    :data:`CONFIG_MAX_BYTES`, its values over 64 KiB of JSON are replaced too (else the whole). The run log's
    header can then never fail to encode, nor be too long to read."""
    replaced: list[str] = []

    def key(k: Any) -> str:
        if isinstance(k, str):
            return k
        if isinstance(k, enum.Enum):
            return f"{type(k).__name__}.{k.name}"
        item = getattr(k, "item", None)
        try:
            return str(item() if callable(item) and not isinstance(k, (tuple, list)) else k)
        except Exception:  # noqa: BLE001 - a caller's __str__ that raises
            replaced.append(f"a {type(k).__name__} key (its str() raised)")
            return UNENCODABLE.format(f"a {type(k).__name__} key")

    def mapping(value: Mapping[Any, Any], path: str, inner: tuple[int, ...]) -> Any:
        try:
            items = list(value.items())
        except Exception:  # noqa: BLE001 - a caller's mapping whose items() raises
            replaced.append(f"{path} ({type(value).__name__})")
            return UNENCODABLE.format(type(value).__name__)
        out: dict[str, Any] = {}
        for k, v in items:
            name = key(k)
            while name in out:
                replaced.append(f"{path}.{name} (keys equal as text)")
                name = f"{name} <{type(k).__name__}>"
            out[name] = plain(v, f"{path}.{name}", inner)
        return out

    def plain(value: Any, path: str, seen: tuple[int, ...]) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 10_000:
            replaced.append(f"{path} (an int of {value.bit_length()} bits: JSON writes 4,300 digits at most)")
            return UNENCODABLE.format("an int of over 3,000 digits")
        if value is None or isinstance(value, (str, bool, int)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else None
        if isinstance(value, enum.Enum):
            return plain(value.value, path, seen)
        if isinstance(value, os.PathLike):
            return os.fspath(value) if isinstance(os.fspath(value), str) else repr(value)
        if isinstance(value, (dict, list, tuple, set, frozenset)):
            if id(value) in seen:
                replaced.append(f"{path} (a cycle)")
                return CYCLE
            if len(seen) > 64:
                replaced.append(f"{path} (nested too deep)")
                return UNENCODABLE.format("nested too deep")
            inner = (*seen, id(value))
            if isinstance(value, dict):
                return mapping(value, path, inner)
            items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
            return [plain(v, f"{path}[{i}]", inner) for i, v in enumerate(items)]
        item = getattr(value, "item", None)  # a numpy scalar (or a 0-d array, a one-value tensor)
        if callable(item) and getattr(value, "ndim", 0) == 0:
            try:
                return plain(item(), path, seen)
            except (TypeError, ValueError):
                pass
        tolist = getattr(value, "tolist", None)  # a numpy array
        if callable(tolist) and getattr(value, "size", 1 << 20) <= 4096:
            try:
                return plain(tolist(), path, seen)
            except (TypeError, ValueError):
                pass
        replaced.append(f"{path} ({type(value).__name__})")
        return UNENCODABLE.format(type(value).__name__)

    out = plain(config, "run_config", ())
    if (total := len(json.dumps(out))) > CONFIG_MAX_BYTES:  # its values over 64 KiB give way, the rest kept
        replaced.append(f"run_config ({total} bytes of JSON: the header keeps {CONFIG_MAX_BYTES} at most)")
        if isinstance(out, dict):
            sizes = {k: len(json.dumps(v)) for k, v in out.items()}
            out = {k: out[k] if n <= 1 << 16 else UNENCODABLE.format(f"{n} bytes of JSON") for k, n in sizes.items()}
        if not isinstance(out, dict) or len(json.dumps(out)) > CONFIG_MAX_BYTES:  # many small values
            out = UNENCODABLE.format(f"{total} bytes of JSON")
    if replaced:
        warn(f"rankmem: run_config holds what the run log's header cannot keep as it is: {replaced[0]}"
             f"{f' and {len(replaced) - 1} more' if len(replaced) > 1 else ''}; the header holds "
             f"{CYCLE!r}, {UNENCODABLE.format('...')!r} or the key with its type's name there instead",
             stacklevel=4)
    return out
WORK_MAX = 2.0**40
"""No micro-batch holds more tokens or sequences (a trillion): a count past it is an overflowed counter or
a mistake, and one such window would bend the advice fit (its squared tokens past 2**80)."""


def work_numbers(tokens: Any, sequences: Any, sq_tokens: Any) -> tuple[float, float | None, float | None]:
    """``Monitor.micro_batch``'s arguments as floats, each a number (numpy's, a 0-d tensor) in 0..2**40
    (``sq_tokens`` 0..2**80); the optional two stay None."""
    return (_work_number("tokens", tokens), None if sequences is None else _work_number("sequences", sequences),
            None if sq_tokens is None else _work_number("sq_tokens", sq_tokens))


def _work_number(name: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RankmemError(f"micro_batch({name}=...) must be a number, got {value!r}") from None
    top = WORK_MAX**2 if name == "sq_tokens" else WORK_MAX
    if not 0 <= number <= top or isinstance(value, bool):
        raise RankmemError(f"micro_batch({name}=...) must be a number in 0..{top:.0e}, got {value!r}")
    return number
