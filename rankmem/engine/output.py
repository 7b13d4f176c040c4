"""Progress output that never stops training: a closed stdout is redirected to /dev/null, once.

``rankmem train ... | head -1`` (or a ``tee`` that died) closes the pipe on the logging rank's stdout;
the next progress line raised BrokenPipeError there and killed the job a few steps in (issue 11).
:func:`say` swallows it: fd 1 is pointed at ``/dev/null`` (so the bytes still buffered, and the flush at
interpreter exit, go nowhere instead of raising again), one warning goes to stderr, and training goes on.
"""

from __future__ import annotations

import os
import sys

from rankmem.core.warnings import warn

__all__ = ["say"]

_closed = False


def say(text: str) -> None:
    """``print(text, flush=True)``, which a closed stdout cannot turn into an exception."""
    if _closed:
        return
    try:
        print(text, flush=True)
    except (BrokenPipeError, ValueError):  # ValueError: sys.stdout itself was closed
        _silence()
    except OSError as exc:  # EIO (a terminal gone with its ssh session), ENOSPC (a file that filled)
        _silence(exc)


def _silence(exc: OSError | None = None) -> None:
    global _closed
    _closed = True
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError):
        pass
    why = "closed (a `| head`, or a tee that exited)" if exc is None else f"failing ({exc.strerror or exc})"
    warn(f"rankmem: stdout is {why}; progress output is dropped from here on and training goes on")
