"""rankmem's own helper processes (the side file's writer): left out of the children figures.

The children figures say what a training process's workers hold (dataloader workers, a colocated
engine's helpers). The side-file writer is rankmem's, started by the logging rank (~75 MiB of RSS with
pyarrow): counted there, it would make rank 0 look heavier than the others for rankmem's own reason.
Its memory is on the node and cgroup figures like any process's.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_pids: set[int] = set()


def register(pid: int) -> None:
    with _lock:
        _pids.add(pid)


def unregister(pid: int) -> None:
    with _lock:
        _pids.discard(pid)


def helper_pids() -> frozenset[int]:
    """The PIDs of rankmem's helper processes alive in this process's view."""
    with _lock:
        return frozenset(_pids)
