"""``rankmem watch``: a live per-rank view of a running job, built from the files the job writes.

Three sources, all read without touching the job:

- the run log's newest line (per-rank vectors): each rank's memory at its last collect, read from
  the end of the file by :class:`rankmem.offline.tail.TailFollower`, never whole;
- the heartbeats (``RUN/heartbeat/rank<r>.hb``): each rank's current step and phase, and how long
  ago it last passed a window edge (a rank that stopped beating is the one to look at);
- the events (``RUN/events/rank<r>.jsonl``): OOMs, near-OOMs and kills, as they are written.

:func:`build_frame` turns them into a :class:`Frame` (plain data, tested directly) and
:func:`render_frame` into rich renderables; ``rankmem.cli._watch`` redraws them with ``rich.live``.
The worst rank of each column is the catalogue's (:func:`rankmem.core.catalogue.worse`): the highest
value, or the lowest where low is the danger (headroom).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rankmem.core.catalogue import key_of, worse
from rankmem.core.scalars import to_float
from rankmem.core.text import printable
from rankmem.forensics.events import EVENTS_DIR
from rankmem.forensics.heartbeat import HeartbeatRecord, read_heartbeats
from rankmem.offline.columnar import DetailFollower
from rankmem.offline.events import read_events
from rankmem.offline.report import describe_event
from rankmem.offline.runlog import header_world_size
from rankmem.offline.tail import Tail, TailFollower, read_header_line
from rankmem.runlog import RUN_LOG_NAME
from rankmem.runlog.layout import INLINE, detail_path

# (column label, WindowBytes field): what a rank row shows, in this order, where the log has it.
COLUMNS = (
    ("rss", "rss"),
    ("peak rss", "peak_rss"),
    ("dev reserved", "reserved"),
    ("dev peak", "peak_reserved"),
    ("headroom", "headroom"),
    ("children", "children_rss"),
    ("dev children", "device_descendants"),  # device memory by owner (docs/device-attribution.md)
    ("dev foreign", "device_foreign"),
)
# What bounds the ranks, for the title: (label, field); the least over ranks binds first.
CAPACITY = (("device total", "total"), ("node available", "node_available"), ("cgroup limit", "cgroup_limit"))
EVENTS_SHOWN = 5
WORST_MARK = "*"


def run_dir_of(path: str) -> str:
    """A run directory, or the run log inside one -> the run directory."""
    return os.path.dirname(os.path.abspath(path)) if path.endswith(".jsonl") or os.path.isfile(path) else path


@dataclass
class RankRow:
    rank: int
    step: int | None = None
    """The step of the rank's last window edge (heartbeat); None before its first."""
    phase: str | None = None
    """The phase open at that edge ("" between phases); None without a heartbeat."""
    beat_age_s: float | None = None
    exited: bool = False
    values: dict[str, float | None] = field(default_factory=dict)
    """Column key -> this rank's value in the newest logged step (GiB)."""


@dataclass
class Frame:
    """One screen of ``rankmem watch``."""

    run_dir: str
    now: float
    world_size: int
    hosts: list[str]
    step: int | None
    """The newest logged step; None before the first."""
    logged_at: float | None
    step_time_s: float | None
    """Wall time per step between the two newest logged steps."""
    columns: list[tuple[str, str]]
    """(label, key) of the columns the log has."""
    rows: list[RankRow]
    worst: dict[str, int]
    """Column key -> the worst rank (only with more than one rank reporting it)."""
    capacity: list[tuple[str, float]]
    """(label, GiB) of what bounds the ranks (:data:`CAPACITY`), the least over ranks."""
    events: list[dict[str, Any]]
    """The newest events, oldest first (at most :data:`EVENTS_SHOWN`)."""
    event_count: int
    detail_step: int | None = None
    """The step of the per-rank values shown, when they come from the side file (its last batch may be
    up to a second behind the newest line; past the crossover, the last collect that carried them)."""
    detail_note: str | None = None
    """Why the side file is no longer followed (a damaged batch, another run's file), or None."""


def _vector(step: dict[str, Any], key: str, world: int) -> list[float | None]:
    raw = step.get("ranks", {}).get(key)
    if not isinstance(raw, list):
        return [None] * world
    out: list[float | None] = []
    for v in raw[:world]:
        number = to_float(v)  # None for a string, a list, or an int past float64
        out.append(number if number is not None and math.isfinite(number) else None)
    return out + [None] * (world - len(out))


def worst_rank(key: str, values: Sequence[float | None]) -> int | None:
    """The rank holding the worst value of ``key`` (ties: the lowest rank); None when fewer than two
    ranks report it or all report the same value: then no rank is worse than another."""
    present = [(v, r) for r, v in enumerate(values) if v is not None]
    if len(present) < 2 or len({v for v, _ in present}) == 1:
        return None
    if worse(key) == "low":
        return min(present, key=lambda vr: (vr[0], vr[1]))[1]
    return min(present, key=lambda vr: (-vr[0], vr[1]))[1]


def build_frame(run_dir: str, tail: Tail, beats: dict[int, HeartbeatRecord], events: list[dict[str, Any]],
                now: float | None = None, detail: tuple[int, dict[str, list[float | None]]] | None = None) -> Frame:
    """The screen for a run log's ``tail``, the ranks' heartbeats and the run's events. ``detail``: the
    newest (step, per-rank values) of the side file, for a log whose lines hold the aggregates only."""
    now = time.time() if now is None else now
    header = tail.header or {}
    last = tail.steps[-1] if tail.steps else None
    detail_step = None
    if last is not None and not isinstance(last.get("ranks"), dict) and detail is not None:
        detail_step = detail[0]
        last = {**last, "ranks": detail[1]}
    # A header says the world size (checked as the reader checks it: a damaged one is one error line);
    # before it is written, the heartbeats do.
    world = header_world_size(header, os.path.join(run_dir, RUN_LOG_NAME)) if "world_size" in header else (max(beats) + 1 if beats else 0)
    hosts = sorted({str(r.get("host")) for r in header.get("ranks", []) if isinstance(r, dict)})
    step_time = None
    if len(tail.steps) >= 2:
        (a, b) = tail.steps[-2:]
        ds, dt = b.get("step"), b.get("time")
        if isinstance(ds, int) and isinstance(a.get("step"), int) and isinstance(dt, (int, float)) \
                and isinstance(a.get("time"), (int, float)) and ds > a["step"]:
            step_time = (dt - a["time"]) / (ds - a["step"])
    columns: list[tuple[str, str]] = []
    vectors: dict[str, list[float | None]] = {}
    if last is not None:
        for label, name in COLUMNS:
            key = key_of(name)
            vec = _vector(last, key, world)
            if any(v is not None for v in vec):
                columns.append((label, key))
                vectors[key] = vec
    rows = []
    for rank in range(world):
        row = RankRow(rank, values={key: vec[rank] for key, vec in vectors.items()})
        beat = beats.get(rank)
        if beat is not None:
            row.step, row.phase, row.exited = beat.step, beat.phase, beat.clean
            row.beat_age_s = max(0.0, now - beat.time)
        rows.append(row)
    worst = {key: r for key, vec in vectors.items() if (r := worst_rank(key, vec)) is not None}
    capacity = []
    if last is not None:
        for label, name in CAPACITY:
            present = [v for v in _vector(last, key_of(name), world) if v is not None]
            if present:
                capacity.append((label, min(present)))
    return Frame(
        run_dir=run_dir, now=now, world_size=world, hosts=hosts,
        step=int(last["step"]) if last is not None else None,
        logged_at=float(last["time"]) if last is not None and isinstance(last.get("time"), (int, float)) else None,
        step_time_s=step_time, columns=columns, rows=rows, worst=worst, capacity=capacity, detail_step=detail_step,
        events=events[-EVENTS_SHOWN:], event_count=len(events),
    )


class Watcher:
    """Follows one run directory: each :meth:`frame` call reads what changed since the last one."""

    def __init__(self, run: str) -> None:
        self.run_dir = run_dir_of(run)
        log = run if run.endswith(".jsonl") else os.path.join(self.run_dir, RUN_LOG_NAME)
        self.log_path = log
        self.follower = TailFollower(log, count=2)
        self._events_stamp: tuple[tuple[str, int, int], ...] = ()
        self._events: list[dict[str, Any]] = []
        self._detail_follower: DetailFollower | None = None
        self.events_skipped: list[str] = []
        """Event files not read (a FIFO, a device), each with why: the title says so."""

    def _read_events(self) -> list[dict[str, Any]]:
        directory = os.path.join(self.run_dir, EVENTS_DIR)
        try:
            stamp = tuple(sorted((e.name, (s := e.stat()).st_size, s.st_ino) for e in os.scandir(directory)))
        except OSError:
            stamp = ()
        if stamp != self._events_stamp:  # a new or grown events file: read them again (they are small)
            read = read_events(self.run_dir)
            self._events_stamp, self._events, self.events_skipped = stamp, read.events, read.skipped
        return self._events

    def _detail(self, header: dict[str, Any] | None) -> tuple[int, dict[str, list[float | None]]] | None:
        name = (header or {}).get("detail")
        if not isinstance(name, str) or name == INLINE:
            return None
        path = detail_path(self.log_path, name)
        if self._detail_follower is None or self._detail_follower.path != path:
            self._detail_follower = DetailFollower(path)
        self._detail_follower.header_line = read_header_line(self.log_path)  # a restart writes a new one
        return self._detail_follower.poll()

    def frame(self, now: float | None = None) -> Frame:
        tail = self.follower.poll()
        beats = read_heartbeats(os.path.join(self.run_dir, "heartbeat"))
        frame = build_frame(self.run_dir, tail, beats, self._read_events(), now, detail=self._detail(tail.header))
        follower = self._detail_follower
        if tail.header is None and tail.steps:
            frame.detail_note = f"{self.log_path}: its first line is not a rankmem header (damaged): world size unknown"
        elif follower is not None and follower.damaged:
            frame.detail_note = f"{follower.path}: {follower.damaged}; not followed further"
        elif follower is not None:
            frame.detail_note = follower.check_lines([(s.get("step"), s.get("time")) for s in tail.steps])
        if self.events_skipped:
            skipped = "; ".join(self.events_skipped)
            frame.detail_note = f"{frame.detail_note}; {skipped}" if frame.detail_note else skipped
        return frame


# ---- rendering ----------------------------------------------------------------------------------------

def _clock(t: Any) -> str:
    """An event's time as HH:MM:SS; ``?`` for one that is not a time (another process wrote the line)."""
    t = to_float(t)  # None for a string, or an int no float holds (10**4000)
    if t is None or not math.isfinite(t):
        return "?"
    try:
        return time.strftime("%H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError):
        return "?"


def _age(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 60 else f"{seconds / 60:.0f} min" if seconds < 3600 else f"{seconds / 3600:.1f} h"


def title_lines(frame: Frame) -> list[str]:
    hosts = f" on {len(frame.hosts)} host{'s' if len(frame.hosts) != 1 else ''}" if frame.hosts else ""
    head = f"rankmem watch {frame.run_dir}: {frame.world_size} ranks{hosts}"
    if frame.step is None:
        head += ", no step logged yet"
    else:
        head += f", logged step {frame.step}"
        if frame.logged_at is not None:
            head += f" ({_age(max(0.0, frame.now - frame.logged_at))} ago)"
        if frame.step_time_s is not None:
            head += f", step time {frame.step_time_s:.3f} s"
        if frame.detail_step is not None and frame.detail_step != frame.step:
            head += f"; per-rank values of step {frame.detail_step}"
    lines = [head]
    if frame.detail_note:
        lines.append(f"note: {frame.detail_note}")
    if frame.capacity:
        lines.append("limits: " + ", ".join(f"{label} {value:.3f} GiB" for label, value in frame.capacity))
    return lines


def _phase(row: RankRow) -> str:
    if row.phase is None:
        return "?"
    if row.exited:
        return "(exited)"
    return row.phase or "-"


def render_frame(frame: Frame, stale_s: float = 30.0) -> Any:
    """The frame as a rich renderable: title, one row per rank (the worst of each column marked with
    ``*`` and drawn in red), the newest events."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    # Every string is the run's own (its directory, hosts, phases, event fields): shown as text, escaped.
    parts: list[Any] = [Text(printable(line)) for line in title_lines(frame)]
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name, justify in (("rank", "right"), ("step", "right"), ("phase", "left"), ("beat", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for label, key in frame.columns:
        table.add_column(f"{label}\n{'GiB' if key.endswith('_gib') else ''}", justify="right")
    for row in frame.rows:
        # A rank whose last beat is old while the job goes on is the one to look at.
        age = "" if row.beat_age_s is None else _age(row.beat_age_s)
        age_style = "yellow" if row.beat_age_s is not None and row.beat_age_s > stale_s and not row.exited else ""
        cells: list[Any] = [str(row.rank), "" if row.step is None else str(row.step), Text(printable(_phase(row))),
                            Text(age, age_style)]
        for _, key in frame.columns:
            value = row.values.get(key)
            if value is None:
                cells.append("")
            elif frame.worst.get(key) == row.rank:
                cells.append(Text(f"{value:.3f}{WORST_MARK}", "bold red"))
            else:
                cells.append(f"{value:.3f} ")
        table.add_row(*cells)
    parts.append(table)
    if frame.worst:
        parts.append(Text(f"{WORST_MARK} the worst rank of the column (highest; lowest for headroom)", "dim"))
    if frame.event_count:
        parts.append(Text(f"events ({frame.event_count}, newest last):"))
        for e in frame.events:
            when = _clock(e.get("time"))
            parts.append(Text(printable(f"  {when} {describe_event(e)}"), "red" if e.get("kind") in ("oom", "killed") else ""))
    else:
        parts.append(Text("events: none"))
    return Group(*parts)
