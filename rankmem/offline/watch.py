"""``rankmem watch``: a live per-rank view of a running job, built from the files the job writes.

Three sources, read without touching the job: the run log's newest line (each rank's memory at its
last collect, read from the end by :class:`rankmem.offline.follow.Follower`); the heartbeats (each
rank's step, phase and time since its last window edge); the events (OOMs, near-OOMs, kills).
:func:`build_frame` turns them into a :class:`Frame`; :mod:`rankmem.offline.watchview` draws it. The
worst rank of each column is the catalogue's (:func:`rankmem.core.catalogue.worse`).
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rankmem.core.catalogue import key_of, worse
from rankmem.core.events import KILLED, Event
from rankmem.core.records import RunHeader
from rankmem.core.rundir import RunDir
from rankmem.core.scalars import to_float
from rankmem.fit.capacity import Assessment, Capacity, capacities, for_key
from rankmem.forensics.heartbeat import HeartbeatRecord, read_heartbeats
from rankmem.offline.advice import assess
from rankmem.offline.anatomy import compact_lines
from rankmem.offline.events import read_events
from rankmem.offline.follow import Follower, Tail

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
EVENTS_SHOWN = 5


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
    dead: bool = False
    """Killed (a ``killed`` event names it), or its process is gone from this host without exiting cleanly."""
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
    """(label, GiB) of what bounds the ranks (:func:`rankmem.fit.capacity.capacities`), least over ranks."""
    events: list[Event]
    """The newest events, oldest first (at most :data:`EVENTS_SHOWN`)."""
    event_count: int
    limits: dict[str, list[float | None]] = field(default_factory=dict)
    """Column key -> per rank, the binding limit of that usage (GiB): the device total for device keys, the
    least of node total and cgroup limit for host keys (:mod:`rankmem.fit.capacity`'s families)."""
    detail_step: int | None = None
    """The step of the per-rank values shown, when they come from the side file (past the crossover,
    the last collect that carried them)."""
    detail_note: str | None = None
    """Why the side file is no longer followed (a damaged record, another run's file), and the run
    log's gaps, or None."""
    anatomy: list[str] = field(default_factory=list)
    """Per phase with ``Monitor.track``: what fills the highest rank's peak, one line each."""
    advice: Assessment | None = None
    """The limit per rank and each phase's verdict over the run so far, as ``rankmem advise`` says them."""


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


def build_frame(run_dir: str, tail: Tail, beats: dict[int, HeartbeatRecord], events: list[Event],
                now: float | None = None, detail: tuple[int, dict[str, list[float | None]]] | None = None) -> Frame:
    """The screen for a run log's ``tail``, the ranks' heartbeats and the run's events. ``detail``: the
    newest (step, per-rank values) of the side file, for a log whose lines hold the aggregates only."""
    now = time.time() if now is None else now
    header = tail.header
    if tail.header_error is not None:
        raise tail.header_error  # a damaged header is one error line, as read_run says it
    last = tail.steps[-1] if tail.steps else None
    detail_step = None
    if last is not None and not isinstance(last.get("ranks"), dict) and detail is not None:
        detail_step = detail[0]
        last = {**last, "ranks": detail[1]}
    # A header says the world size (checked as the reader checks it: a damaged one is one error line);
    # before it is written, the heartbeats do.
    world = header.world_size if header is not None else (max(beats) + 1 if beats else 0)
    hosts = sorted({r.host for r in header.ranks}) if header is not None else []
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
    _mark_dead(rows, beats, events, hosts_of(header))
    worst = {key: r for key, vec in vectors.items() if (r := worst_rank(key, vec)) is not None}
    caps = capacities(_last_series(last, world), np.array([last["step"]])) if last is not None else []
    return Frame(
        run_dir=run_dir, now=now, world_size=world, hosts=hosts,
        step=int(last["step"]) if last is not None else None,
        logged_at=float(last["time"]) if last is not None and isinstance(last.get("time"), (int, float)) else None,
        step_time_s=step_time, columns=columns, rows=rows, worst=worst, detail_step=detail_step,
        capacity=[(c.label, c.value) for c in caps], limits=_limits(caps, columns),
        events=events[-EVENTS_SHOWN:], event_count=len(events),
        anatomy=compact_lines({k: _vector(last, k, world) for k in last["ranks"] if "/anatomy/" in k})
        if last is not None and isinstance(last.get("ranks"), dict) else [],
    )


def hosts_of(header: RunHeader | None) -> list[str | None]:
    """Each rank's host as the header's ``ranks`` list gives it (None where it does not)."""
    return [r.host or None for r in header.ranks] if header is not None else []


def _mark_dead(rows: list[RankRow], beats: dict[int, HeartbeatRecord], events: list[Event],
               hosts: list[str | None]) -> None:
    killed = {e.rank for e in events if e.kind == KILLED}
    here = socket.gethostname()
    for row in rows:
        beat = beats.get(row.rank)
        if row.rank in killed:
            row.dead = True
        elif beat is not None and not beat.clean and row.rank < len(hosts) and hosts[row.rank] == here:
            row.dead = not _alive(beat.pid)  # a pid can only be asked about on its own host


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def _last_series(last: dict[str, Any], world: int) -> dict[str, np.ndarray]:
    """The newest step's per-rank values as a key -> (1 x world) mapping (nan where a rank has none)."""
    return {key: np.array([[math.nan if v is None else v for v in _vector(last, key, world)]])
            for key in last.get("ranks", {})}


def _limits(caps: list[Capacity], columns: list[tuple[str, str]]) -> dict[str, list[float | None]]:
    """Per usage column, each rank's tightest capacity (headroom is already a distance to its limit)."""
    out: dict[str, list[float | None]] = {}
    for _, key in columns:
        bound = [c.matrix[-1] for c in for_key(caps, key)]
        if bound:
            out[key] = [float(v) if math.isfinite(v) else None for v in np.fmin.reduce(bound)]
    return out


class Watcher:
    """Follows one run directory: each :meth:`frame` call reads what changed since the last one."""

    def __init__(self, run: str, assess_every_s: float = 30.0) -> None:
        self.run_dir = run_dir_of(run)
        self.assess_every_s = assess_every_s
        """The verdict reads the whole run log: at the first frame, then at most this often."""
        self._assessed: tuple[float, Assessment | None] | None = None
        log = run if run.endswith(".jsonl") else RunDir(self.run_dir).log
        self.log_path = log
        self.follower = Follower(log, count=2)
        self._events_stamp: tuple[tuple[str, int, int], ...] = ()
        self._events: list[Event] = []
        self.events_skipped: list[str] = []
        """Event files not read (a FIFO, a device), each with why: the title says so."""

    def _read_events(self, run_id: str | None) -> list[Event]:
        directory = RunDir(self.run_dir).events
        try:
            stamp = tuple(sorted((e.name, (s := e.stat()).st_size, s.st_ino) for e in os.scandir(directory)))
        except OSError:
            stamp = ()
        if stamp != self._events_stamp:  # a new or grown events file: read them again (they are small)
            read = read_events(self.run_dir, run_id)
            kept = [e for e in read.events if e.kind != "anatomy"]  # window replays, not failures
            self._events_stamp, self._events, self.events_skipped = stamp, kept, read.skipped
        return self._events

    def _assess(self, now: float) -> Assessment | None:
        from rankmem.errors import RankmemError
        from rankmem.offline import read_run

        if self._assessed is None or now - self._assessed[0] >= self.assess_every_s:
            try:
                found: Assessment | None = assess(read_run(self.log_path))
            except (RankmemError, OSError):  # no log yet, or no steps: no verdict in this frame
                found = None
            self._assessed = (now, found)
        return self._assessed[1]

    def frame(self, now: float | None = None) -> Frame:
        tail = self.follower.poll()
        # This run's heartbeats and events only: an earlier run's (not moved aside) are not its ranks.
        run_id = tail.header.run_id if tail.header is not None else None
        beats = read_heartbeats(RunDir(self.run_dir).heartbeat, run_id)
        frame = build_frame(self.run_dir, tail, beats, self._read_events(run_id), now, detail=tail.detail)
        if tail.header is None and tail.header_error is None and tail.steps:
            frame.detail_note = f"{self.log_path}: its first line is not a rankmem header (damaged): world size unknown"
        else:
            frame.detail_note = "; ".join(([tail.note] if tail.note else []) + [f"gap: {g}" for g in tail.gaps]) or None
        frame.advice = self._assess(frame.now)
        if self.events_skipped:
            skipped = "; ".join(self.events_skipped)
            frame.detail_note = f"{frame.detail_note}; {skipped}" if frame.detail_note else skipped
        return frame

