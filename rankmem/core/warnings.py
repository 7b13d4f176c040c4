"""rankmem's warnings: shown at the user's line, never raised, once per condition.

Under ``-W error`` a warning becomes an exception; telemetry must not kill training, so :func:`warn`
swallows whatever ``warnings.warn`` raises.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Any

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The reference worker is one of rankmem's *callers*: a warning raised under it belongs at its line.
_CALLER_DIRS = (os.path.join(_PACKAGE_DIR, "engine") + os.sep,)
# Frames that are nobody's line: a thread's bootstrap and ``python -m``'s runner.
_NOBODY = (os.path.abspath(threading.__file__), "<frozen runpy>")
_NO_CALLER_REGISTRY: dict[Any, Any] = {}


def _internal(filename: str) -> bool:
    path = filename if os.path.isabs(filename) or filename.startswith("<") else os.path.abspath(filename)
    return path.startswith(_PACKAGE_DIR + os.sep) and not path.startswith(_CALLER_DIRS)


def caller_stacklevel() -> int | None:
    """The ``stacklevel`` for a ``warnings.warn`` in the function that calls this one that names the
    first frame outside rankmem (the user's line); None when there is none: a thread rankmem started,
    whose stack is rankmem's own down to the thread's bootstrap."""
    frame = sys._getframe(2)  # stacklevel 2 of our caller's warnings.warn: its own caller
    level = 2
    while frame is not None:
        name = frame.f_code.co_filename
        if not _internal(name):
            return None if name in _NOBODY else level
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return None


def warn(message: str, stacklevel: int = 2) -> None:
    """A ``RuntimeWarning`` that can never raise, shown at the caller's line.

    Under ``-W error`` a warning becomes an exception, and telemetry must not kill training. The line it
    names is the first frame outside rankmem (the user's ``monitor.collect(...)``); a warning from a thread
    rankmem runs has no such line and names ``rankmem:0``.
    """
    try:
        level = caller_stacklevel()
        if level is None:
            warnings.warn_explicit(message, RuntimeWarning, "rankmem", 0, module="rankmem",
                                   registry=_NO_CALLER_REGISTRY)
        else:
            warnings.warn(message, RuntimeWarning, stacklevel=level)
    except Exception:  # noqa: BLE001 - a boundary (rankmem.core.guard): the warning channel itself
        pass


class WarnOnce:
    """Telemetry warns about a condition once, not every step: one ``RuntimeWarning`` per key."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def __call__(self, key: str, message: str, stacklevel: int = 3) -> None:
        if key not in self._seen:
            self._seen.add(key)
            warn(f"rankmem: {message}", stacklevel=stacklevel + 1)
