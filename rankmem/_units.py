"""Byte units. Records hold integer bytes; conversion happens once, where metrics are named."""

from __future__ import annotations

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30  # the "GiB" of every `_gib` key; verl's "gb" is this too (it divides by 1024**3)


def to_gib(n: int | None) -> float | None:
    """Bytes to GiB, keeping "unavailable" (None) as it is."""
    return None if n is None else n / GIB
