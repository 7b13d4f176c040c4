"""Counts the job's forensic events by kind, for the ``prometheus`` sink's ``rankmem_events_total``.

Every rank appends its own ``<out_dir>/events/rank<r>.jsonl`` (:mod:`rankmem.forensics.events`); this
reads only what was appended since the last count (an offset per file), so a scrape costs a directory
listing and a ``stat`` per events file, and most runs have no such file at all. A torn last line (a
write in progress) is left for the next count; a line that is not an event is skipped.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter

from rankmem.forensics.events import EVENTS_DIR, KINDS

_MAX_READ = 1 << 20  # bytes read per file per count: a flood of events is caught up over several scrapes


class EventCounter:
    """Events by kind (``oom``, ``near_oom``, ``killed``, ``stalled``) under ``out_dir``; safe from any thread."""

    def __init__(self, out_dir: str | None) -> None:
        self._dir = None if out_dir is None else os.path.join(out_dir, EVENTS_DIR)
        self._offsets: dict[str, int] = {}
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()  # two scrapes at once must not count one line twice

    def counts(self) -> dict[str, int]:
        if self._dir is None:
            return {}
        with self._lock:
            try:
                names = [n for n in os.listdir(self._dir) if n.endswith(".jsonl")]
            except OSError:  # no event yet: the directory appears with the first
                names = []
            for name in names:
                self._read(os.path.join(self._dir, name))
            return dict(self._counts)

    def _read(self, path: str) -> None:
        offset = self._offsets.get(path, 0)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read(_MAX_READ)
        except OSError:
            return
        end = chunk.rfind(b"\n") + 1
        for line in chunk[:end].splitlines():
            try:
                kind = json.loads(line).get("kind")
            except (ValueError, AttributeError, RecursionError):  # not JSON, not an object, nested past the parser
                continue
            if kind in KINDS:
                self._counts[kind] += 1
        self._offsets[path] = offset + end
