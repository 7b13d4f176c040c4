"""At SIGTERM, SIGINT or SIGHUP, the logging rank's pending records reach disk before the process ends.

While a publisher is open, the logging rank's main thread handles these signals: it flushes every open
publisher (bounded by :data:`FLUSH_S`), then does what the signal did before: the previous Python
handler is called, and a default SIGTERM is delivered again with its default action restored, so the
process still dies by SIGTERM. An ignored signal stays ignored. Python runs the handler on the main
thread between bytecodes, so a main thread blocked in a collective runs it when the collective returns;
the sink thread is woken at every collect, so the records are normally on disk by then. SIGKILL runs no
code: it can cost the record of a collect returned less than one sink write before it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from rankmem.core.guard import Guard

FLUSH_S = 2.0
"""The most a terminating signal waits for the sinks (torchrun's grace before SIGKILL is 30 s)."""
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_installed: dict[int, Any] = {}  # signal -> the handler ours replaced
_guard = Guard()
_lock = threading.Lock()


def install(flush: Callable[[float], object]) -> None:
    """Handle :data:`SIGNALS` by ``flush(FLUSH_S)`` first; a no-op off the main thread or when installed."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal.signal works only there (a Ray actor's method, a framework's thread)
    with _lock:
        for sig in SIGNALS:
            if sig in _installed:
                continue
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN or previous is None:
                continue  # ignored on purpose, or set from C (not ours to replace)
            try:
                signal.signal(sig, _handler(sig, previous, flush))
            except (ValueError, OSError):
                continue
            _installed[sig] = previous


def _handler(sig: int, previous: Any, flush: Callable[[float], object]) -> Callable[[int, FrameType | None], None]:
    def handle(signum: int, frame: FrameType | None) -> None:
        with _guard.contain("signal", f"flushing the run log at {signal.Signals(signum).name} failed"):
            flush(FLUSH_S)  # the signal's own action follows whatever the flush did
        if callable(previous):
            previous(signum, frame)
            return
        # SIG_DFL: die by the signal, as without rankmem.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    return handle


def uninstall() -> None:
    """Put back the handlers ours replaced (where ours is still the one installed)."""
    if threading.current_thread() is not threading.main_thread():
        return
    with _lock:
        for sig, previous in list(_installed.items()):
            current = signal.getsignal(sig)
            if getattr(current, "__qualname__", "").startswith("_handler."):
                try:
                    signal.signal(sig, previous)
                except (ValueError, OSError):
                    continue
            del _installed[sig]
