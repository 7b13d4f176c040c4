"""Typed fields out of a JSON object another process wrote: the run header, a forensic event.

Every file rankmem reads is untrusted (a crash, a newer version, a hand edit, a foreign writer). A
:class:`Fields` reader takes one field at a time with a converter that returns the typed value or
None: a field that is absent or ``null`` gives the caller's default; one of the wrong type (a string
rank, a NaN time, a 4,000-digit integer) gives the default too, and its value as read is kept in
:attr:`Fields.unread` so that nothing is lost; the fields no converter asked for are :meth:`Fields.extra`
(a newer writer's). No exception leaves a converter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

INT64_MAX = 2**63 - 1


def as_int(value: Any) -> int | None:
    """A JSON integer within int64 (steps, ranks, bytes, pids); a bool is not one."""
    if isinstance(value, int) and not isinstance(value, bool) and -INT64_MAX - 1 <= value <= INT64_MAX:
        return value
    return None


def as_float(value: Any) -> float | None:
    """A finite JSON number as a float (NaN, inf, ints past float64 and bools are not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def as_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def as_object(value: Any) -> dict[str, Any] | None:
    """A JSON object, as a dict (its contents are the consumer's to check)."""
    return value if isinstance(value, dict) else None


def as_list(value: Any) -> list[Any] | None:
    return value if isinstance(value, list) else None


def as_strings(value: Any) -> tuple[str, ...] | None:
    """A list of strings, as a tuple; None when it is not a list or holds anything else."""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


class Fields:
    """Reads the fields of one JSON object: :meth:`take` per known field, then :meth:`extra`."""

    def __init__(self, obj: Mapping[str, Any]) -> None:
        self.obj = obj
        self.unread: dict[str, Any] = {}
        """Known fields whose value was not of their type, as read (the typed attribute has its default)."""
        self._taken: set[str] = set()

    def take(self, name: str, convert: Callable[[Any], T | None], default: T) -> T:
        """Field ``name`` converted; ``default`` when it is absent, ``null`` or not convertible."""
        self._taken.add(name)
        if name not in self.obj:
            return default
        raw = self.obj[name]
        if raw is None:
            return default
        value = convert(raw)
        if value is None:
            self.unread[name] = raw
            return default
        return value

    def optional(self, name: str, convert: Callable[[Any], T | None]) -> T | None:
        """:meth:`take` with None as the default."""
        return self.take(name, convert, None)

    def skip(self, *names: str) -> None:
        """Fields the caller reads itself (or that say what the object is): not extra."""
        self._taken.update(names)

    def extra(self) -> dict[str, Any]:
        """The fields nobody took: a newer writer's, kept as read."""
        return {k: v for k, v in self.obj.items() if k not in self._taken}
