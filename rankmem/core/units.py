"""Byte units. Records hold integer bytes; conversion happens once, where metrics are named."""

from __future__ import annotations

MIB = 1 << 20
GIB = 1 << 30  # the "GiB" of every `_gib` key; verl's "gb" is this too (it divides by 1024**3)
MIB_PER_GIB = 1024.0  # a `_gib` key's value in MiB, where growth is judged

