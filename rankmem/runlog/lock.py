"""The run directory's lock lives with the run directory (:mod:`rankmem.core.lock`); kept here for imports."""

from __future__ import annotations

from rankmem.core.lock import ENV_HELD, LOCK_NAME, RunDirLock

__all__ = ["ENV_HELD", "LOCK_NAME", "RunDirLock"]
