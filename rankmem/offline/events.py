"""Reading every rank's event file of a run directory: merged, ordered, damaged lines counted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from rankmem.core.rundir import RUN_ID_FIELD, RunDir, valid_run_id


@dataclass
class Events:
    """Every rank's events of a run, sorted by time."""

    events: list[dict[str, Any]] = field(default_factory=list)
    corrupt: int = 0
    """Lines skipped: torn (a rank died mid-write), not JSON, or not an event object."""
    foreign: int = 0
    """Events of another run (their ``run_id`` is not the log's): named, not read."""
    foreign_files: list[str] = field(default_factory=list)


def read_events(run_dir: str, run_id: str | None = None) -> Events:
    """Merge ``<run_dir>/events/rank*.jsonl`` (``run_dir`` may also be the run log's path: a rotated
    ``rankmem.jsonl.N`` reads ``events.N/``). A missing events directory is no events. With ``run_id``
    (the log header's), an event that carries another run's id is counted in ``foreign``, not read."""
    directory = RunDir.events_of(run_dir)
    out = Events()
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith("rank") and n.endswith(".jsonl"))
    except OSError:
        return out
    for name in names:
        try:
            with open(os.path.join(directory, name), "rb") as f:
                data = f.read()
        except OSError:
            continue
        lines = data.split(b"\n")
        # Every whole line ends in "\n": what follows the last one is a torn write (or nothing).
        if lines[-1].strip():
            out.corrupt += 1
        for line in lines[:-1]:
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError:
                out.corrupt += 1
                continue
            if not isinstance(event, dict) or "kind" not in event:
                out.corrupt += 1
                continue
            written = valid_run_id(event.get(RUN_ID_FIELD))
            if run_id is not None and written is not None and written != run_id:
                out.foreign += 1
                if name not in out.foreign_files:
                    out.foreign_files.append(name)
                continue
            out.events.append(event)
    out.events.sort(key=_order)
    return out


def _order(event: dict[str, Any]) -> tuple[float, int]:
    t, rank = event.get("time"), event.get("rank")
    return (float(t) if isinstance(t, (int, float)) else float("inf"),
            rank if isinstance(rank, int) else -1)
