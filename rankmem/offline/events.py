"""Reading every rank's event file of a run directory: merged, ordered, damaged lines counted.

Each line is parsed into its typed record (:mod:`rankmem.core.events`): a line that is not JSON,
not an object with a ``kind`` string, or nested past :data:`MAX_DEPTH` is counted as corrupt; an event
whose fields are of the wrong type keeps its place with those fields at their defaults (their values
kept in ``Event.unread``), and the fields a newer writer adds are kept in ``Event.extra``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from rankmem.core.events import Event, parse_event
from rankmem.core.rundir import NotRegularFile, RunDir, open_binary

MAX_EVENTS_BYTES = 64 << 20
"""Bytes of one rank's event file read at most (an event is a few KB; a rank records a handful)."""
MAX_DEPTH = 16
"""Deepest nesting an event may have (the writer's nest three deep); a deeper line counts as corrupt."""


@dataclass
class Events:
    """Every rank's events of a run, sorted by time."""

    events: list[Event] = field(default_factory=list)
    corrupt: int = 0
    """Lines skipped: torn (a rank died mid-write), not JSON, or not an event object (no ``kind`` string)."""
    foreign: int = 0
    """Events of another run (their ``run_id`` is not the log's): named, not read."""
    foreign_files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Event files not read whole, each with why (a FIFO, a device, past :data:`MAX_EVENTS_BYTES`)."""


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
        path = os.path.join(directory, name)
        try:
            with open_binary(path) as f:  # a FIFO here blocked report and watch in open()
                data = f.read(MAX_EVENTS_BYTES + 1)
        except NotRegularFile as exc:
            out.skipped.append(str(exc))
            continue
        except OSError:
            continue
        if len(data) > MAX_EVENTS_BYTES:
            out.skipped.append(f"{path} holds more than {MAX_EVENTS_BYTES >> 20} MiB of events; read its first "
                               f"{MAX_EVENTS_BYTES >> 20} MiB")
            data = data[: data.rfind(b"\n", 0, MAX_EVENTS_BYTES) + 1]
        lines = data.split(b"\n")
        # Every whole line ends in "\n": what follows the last one is a torn write (or nothing).
        if lines[-1].strip():
            out.corrupt += 1
        for line in lines[:-1]:
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except (ValueError, RecursionError):  # not JSON; nested past the parser's depth
                out.corrupt += 1
                continue
            typed = parse_event(event) if isinstance(event, dict) and _depth(event) <= MAX_DEPTH else None
            if typed is None:
                out.corrupt += 1
                continue
            if run_id is not None and typed.run_id is not None and typed.run_id != run_id:
                out.foreign += 1
                if name not in out.foreign_files:
                    out.foreign_files.append(name)
                continue
            out.events.append(typed)
    out.events.sort(key=_order)
    return out


def _depth(obj: Any) -> int:
    """How deeply ``obj`` nests lists and objects (iteratively: a deep one must not recurse)."""
    deepest, todo = 0, [(obj, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_DEPTH:
                return depth
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _order(event: Event) -> tuple[float, int]:
    """By time (an event without one last), then rank (one without first)."""
    return (event.time if event.time is not None else float("inf"), event.rank if event.rank is not None else -1)
