"""Hand glibc's freed heap back to the kernel between steps, so that each step's host peak is its own.

A packed micro-batch on the CPU makes many small blocks (per-sequence attention pieces, autograd nodes):
below the mmap threshold they come from glibc's heap, and when freed they stay resident in its free
lists. The heap then holds the high-water mark of the largest micro-batch seen: resident memory between
steps creeps up with it (measured in bench/bench_advise.py: +27 MiB from 2k to 3k tokens on the bench's
model), and a later, smaller step's peak includes what a larger one left. ``malloc_trim(0)`` returns the
free pages (also those inside the heap, not only its top) to the kernel; the next step faults them back
in, inside its own window. Only the reference worker calls it (its token-budget jobs): it takes about a
millisecond, and what a user's job does with its allocator is theirs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim  # glibc only: musl and macOS have none
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


def release_freed_heap() -> bool:
    """Return glibc's free heap pages to the kernel; False where the C library has no ``malloc_trim``."""
    trim = _trim()
    if trim is None:
        return False
    trim(0)
    return True
