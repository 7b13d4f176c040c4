"""A refresh cadence for figures read more slowly than every window edge (children, node-wide files)."""

from __future__ import annotations

import time


class Every:
    """A refresh cadence: :meth:`due` is True at the first call, then at most once per ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._at = -float("inf")

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._at < self.seconds:
            return False
        self._at = now
        return True

    def expire(self) -> None:
        """Make the next :meth:`due` True (after a fork, the children are another process's)."""
        self._at = -float("inf")
