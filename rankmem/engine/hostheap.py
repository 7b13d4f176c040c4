"""Hand glibc's freed heap back to the kernel between steps, so that each step's host peak is its own.

The many small blocks of a packed CPU micro-batch stay resident in glibc's free lists once freed, so
the heap holds the high-water mark of the largest micro-batch seen and a later, smaller step's peak
includes it. ``malloc_trim(0)`` returns the free pages to the kernel. Only the reference worker calls
it: what a user's job does with its allocator is theirs.
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
