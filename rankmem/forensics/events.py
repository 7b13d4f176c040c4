"""Forensic events: what happened to a rank at the moment that matters (an OOM, a near-OOM, a kill).

Each rank appends to its own ``<out_dir>/events/rank<r>.jsonl``, one JSON object per line, written
whole by one ``os.write`` on an ``O_APPEND`` descriptor the moment it happens: the process may be
about to die, and a line in the kernel's page cache outlives the process (no ``fsync``: only a
machine crash loses it, and then the run is lost anyway). No collective and no device
synchronisation happen here; the other ranks may be inside one.

An event is a typed record (:mod:`rankmem.core.events`, which the reader parses lines back
into): ``kind`` (``oom``, ``near_oom``, ``killed``, ``stalled``), ``rank``, ``step``, ``phase``,
``time`` (Unix seconds) and ``run_id`` (the run it belongs to: readers name another run's events
instead of reading them), then its kind's fields. Byte figures are integer bytes under keys ending in
``_bytes``. This module imports neither torch nor numpy: the offline reader and the launcher use it too.
"""

from __future__ import annotations

import errno
import json
import os
import re
import time
from dataclasses import replace
from typing import Any

from rankmem.core.events import KINDS, Event, OomEvent
from rankmem.core.rundir import EVENTS_DIR, RunDir, open_regular, unlinked
from rankmem.core.scalars import json_safe, to_float
from rankmem.core.warnings import WarnOnce
from rankmem.probe import procfs as _procfs

__all__ = ["EVENTS_DIR", "KINDS", "EventWriter", "encode_event", "events_path", "oom_event", "oom_where"]


def events_path(out_dir: str, rank: int) -> str:
    return RunDir(out_dir).event_file(rank)


def _default(obj: Any) -> Any:
    # numpy and 0-d torch scalars arrive from figures; anything else is named, not dropped.
    number = to_float(obj)
    return str(obj) if number is None else number


def encode_event(event: Event) -> bytes:
    """One JSON line of :meth:`Event.to_json`; NaN and inf become ``null`` (JSON has no NaN)."""
    text = json.dumps(json_safe(event.to_json()), allow_nan=False, separators=(",", ":"), default=_default)
    return text.encode("utf-8") + b"\n"


class EventWriter:
    """Appends this rank's events to ``<out_dir>/events/rank<rank>.jsonl``; never raises, never blocks.

    The file is opened on the first event, without blocking and only if it is a regular file. A directory
    that cannot be written gives one ``RuntimeWarning`` and disables the writer: training goes on.
    """

    def __init__(self, out_dir: str, rank: int, run_id: str | None = None) -> None:
        self.path = events_path(out_dir, rank)
        self.rank = rank
        self.run_id = run_id
        """Written into every event: the run it belongs to."""
        self._fd: int | None = None
        self._disabled = False
        self._warn_once = WarnOnce()

    def write(self, event: Event) -> bool:
        """Append ``event`` (``rank`` and ``time`` filled in when None, ``run_id`` this writer's); False
        when it was not written."""
        if self._disabled:
            return False
        try:
            line = encode_event(replace(event, rank=self.rank if event.rank is None else event.rank,
                                        time=time.time() if event.time is None else event.time, run_id=self.run_id))
        except (TypeError, ValueError, RecursionError, MemoryError) as exc:  # MemoryError: on the way out of a host OOM
            self._warn_once("encode", f"cannot encode a {event.kind!r} event ({exc!r}); it is skipped")
            return False
        try:
            if self._fd is None:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                self._fd = open_regular(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            if unlinked(self._fd):  # the run directory was deleted: this line would go nowhere
                raise OSError(errno.ENOENT, "the file was deleted while the run wrote it (its directory removed?)",
                              self.path)
            written = os.write(self._fd, line)
            # A regular file takes the whole line in one write; a short one (disk full) is finished so
            # the file never holds half a line followed by the next event.
            while written < len(line):
                written += os.write(self._fd, line[written:])
            return True
        except OSError as exc:
            self._disabled = True
            self._warn_once("events", f"cannot write events to {self.path} ({exc}); events are disabled, "
                                      "training goes on")
            return False

    def close(self) -> None:
        _procfs.close_fd(self._fd)
        self._fd = None








# ---- OOM events from exceptions ---------------------------------------------------------------------
# torch's allocator formats sizes as "N bytes", "N.NN KiB", "N.NN MiB", "N.NN GiB" (c10 format_size);
# older builds and other accelerators' plugins say KB/MB/GB meaning the same powers of two.
_UNITS = {"b": 1, "byte": 1, "bytes": 1, "kib": 1 << 10, "kb": 1 << 10, "mib": 1 << 20, "mb": 1 << 20,
          "gib": 1 << 30, "gb": 1 << 30, "tib": 1 << 40, "tb": 1 << 40}
_SIZE = r"(\d+(?:\.\d+)?)\s*(bytes|byte|B|KiB|KB|MiB|MB|GiB|GB|TiB|TB)\b"
_REQUESTED = re.compile(r"Tried to allocate " + _SIZE, re.IGNORECASE)
# "GPU 0 has a total capacity of 79.15 GiB of which 20.56 MiB is free."
_CAPACITY = re.compile(r"total capacity of " + _SIZE + r" of which " + _SIZE + r" is free", re.IGNORECASE)


_CPU_ALLOCATOR = "DefaultCPUAllocator: can't allocate memory"


def _bytes(number: str, unit: str) -> int:
    return round(float(number) * _UNITS[unit.lower()])


def oom_where(exc: BaseException) -> str | None:
    """``"host"`` for a host allocation that failed, ``"device"`` for an accelerator's out-of-memory
    error, else None.

    Host: ``MemoryError``, torch's CPU allocator's ``RuntimeError`` ("DefaultCPUAllocator: can't allocate
    memory"), an ``OSError`` with ``ENOMEM``. Device: ``torch.OutOfMemoryError``, matched by class name (no
    torch import), or a plain ``RuntimeError`` whose text says "out of memory" (torch_npu, older builds).
    """
    if isinstance(exc, MemoryError):
        return "host"
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        return "host"
    if isinstance(exc, RuntimeError) and _CPU_ALLOCATOR in str(exc):
        return "host"
    if any("OutOfMemory" in cls.__name__ for cls in type(exc).__mro__):
        return "device"
    if isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower():
        return "device"
    return None


def oom_event(
    exc: BaseException,
    rank: int,
    step: int | None,
    phase: str | None,
    host_figures: dict[str, Any],
    device_figures: dict[str, Any] | None,
) -> OomEvent:
    """The ``oom`` event for ``exc`` leaving a window: where it happened, the error, the requested size
    where the error text gives it, and the caller's figures at that instant (bytes). Pure: reads
    nothing but its arguments, so it is safe on the failure path."""
    text = str(exc)
    first = text.strip().splitlines()[0] if text.strip() else ""
    requested = _REQUESTED.search(text)
    capacity = _CAPACITY.search(text)
    return OomEvent(
        rank=rank, step=step, phase=phase, time=time.time(),
        where=oom_where(exc) or "unknown",
        error=f"{type(exc).__name__}: {first}" if first else type(exc).__name__,
        requested_bytes=_bytes(*requested.groups()) if requested else None,
        error_total_bytes=_bytes(capacity[1], capacity[2]) if capacity else None,
        error_free_bytes=_bytes(capacity[3], capacity[4]) if capacity else None,
        host=dict(host_figures),
        device=dict(device_figures) if device_figures is not None else None,
    )
