"""Typed forensic events: what the writers build (:mod:`rankmem.forensics`, the launcher's diagnosis)
and what the reader (:mod:`rankmem.offline.events`) parses each event line back into.

One record per kind: :class:`OomEvent`, :class:`NearOomEvent`, :class:`KilledEvent`,
:class:`StalledEvent`; a kind this version does not know (a newer writer's) reads as a plain
:class:`Event`. :meth:`Event.to_json` is the line's object, :func:`parse_event` its inverse. Byte
figures are integer bytes under names ending in ``_bytes``. The nested tables (an OOM's host and
device figures, a near-OOM's per-node process table, a device split by owner) stay JSON objects: their
readers check each entry (``rankmem.offline.report``). Core code: no torch, no numpy, nothing above it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from rankmem.core.rundir import RUN_ID_FIELD, valid_run_id
from rankmem.core.untrusted import (
    INT64_MAX,
    Fields,
    as_float,
    as_int,
    as_list,
    as_object,
    as_str,
    as_strings,
)

__all__ = ["KINDS", "Event", "KilledEvent", "NearOomEvent", "OomEvent", "StalledEvent", "parse_event"]

OOM, NEAR_OOM, KILLED, STALLED = "oom", "near_oom", "killed", "stalled"
KINDS = (OOM, NEAR_OOM, KILLED, STALLED)


def as_bytes(value: Any) -> int | None:
    """A byte count: a JSON integer, or a whole finite number another writer wrote as a float."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= INT64_MAX:
        return int(value)
    return as_int(value)


def _as_counts(value: Any) -> list[int | None] | None:
    """A list of counts, ``null`` where one was unreadable (the OOM-kill counters before and after)."""
    if isinstance(value, list) and all(v is None or as_int(v) is not None for v in value):
        return list(value)
    return None


@dataclass(frozen=True, kw_only=True)
class Event:
    """What every event carries: who, where, when. ``None`` where the line does not say (or says it in a
    type that is not the field's: that value is in :attr:`unread`)."""

    kind: str = ""
    """``oom``, ``near_oom``, ``killed``, ``stalled``, or a kind a newer rankmem writes."""
    rank: int | None = None
    step: int | None = None
    phase: str | None = None
    time: float | None = None
    """Unix seconds."""
    run_id: str | None = None
    """The run the event belongs to (the run log header's ``run_id``)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields this version does not know (a newer writer's), as read; written back by :meth:`to_json`."""
    unread: dict[str, Any] = field(default_factory=dict)
    """Known fields whose value was not of their type (a string rank, a NaN, an integer past int64), as
    read: the attribute holds its default, the value is kept (``report --json`` shows it)."""

    _common: ClassVar[tuple[str, ...]] = ("kind", "rank", "step", "phase", "time")

    def own_fields(self) -> list[str]:
        """This kind's fields beyond the common ones, in the order they are written."""
        skip = {*self._common, RUN_ID_FIELD, "extra", "unread"}
        return [f.name for f in fields(self) if f.name not in skip]

    def to_json(self) -> dict[str, Any]:
        """The event line's object: the common fields, this kind's, the extra ones, then ``run_id``."""
        out: dict[str, Any] = {name: getattr(self, name) for name in self._common}
        for name in self.own_fields():
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        out.update(self.extra)
        out.update(self.unread)
        out[RUN_ID_FIELD] = self.run_id
        return out

    def shown(self, name: str) -> Any:
        """Field ``name`` for display: its typed value, else what the line held there (see :attr:`unread`)."""
        value = getattr(self, name, None)
        return self.unread.get(name) if value is None else value


@dataclass(frozen=True, kw_only=True)
class OomEvent(Event):
    """An out-of-memory error left a window (or the CUDA allocator's observer saw one)."""

    kind: str = field(default=OOM, init=False)
    where: str = "unknown"
    """``host``, ``device`` or ``unknown``."""
    error: str | None = None
    """``Type: first line of the message``."""
    requested_bytes: int | None = None
    """The failed allocation's size, where the message or the observer gives it."""
    error_total_bytes: int | None = None
    """The device's capacity as the message states it."""
    error_free_bytes: int | None = None
    """Free device memory as the message states it."""
    host: dict[str, Any] | None = None
    """Host figures at the failure: ``rss_bytes``, ``window_peak_rss_bytes``, ``node_available_bytes``,
    ``cgroup_limit_bytes``, ``cgroup_headroom_bytes``."""
    device: dict[str, Any] | None = None
    """Device figures at the failure (``allocated_bytes``, ``reserved_bytes``, ``inactive_split_bytes``,
    ``free_bytes``, ``total_bytes``, ``top_segments``) and ``attribution``, the device split by owner."""
    observer: dict[str, Any] | None = None
    """What the allocator's out-of-memory observer saw: ``device``, ``alloc_bytes``,
    ``device_total_bytes``, ``device_free_bytes``."""
    snapshot: str | None = None
    """Path of the allocation-history snapshot written beside the event (``oom_history``)."""


@dataclass(frozen=True, kw_only=True)
class NearOomEvent(Event):
    """The node's near-OOM watch saw headroom or pressure cross a threshold: the table before a kill."""

    kind: str = field(default=NEAR_OOM, init=False)
    reasons: tuple[str, ...] = ()
    """Which thresholds were crossed (``cgroup_headroom``, ``node_available``, ``pressure``)."""
    cgroup: dict[str, Any] | None = None
    node: dict[str, Any] | None = None
    pressure: dict[str, Any] | None = None
    processes: list[Any] | None = None
    """The per-node table of every rank and its descendants (one object per process)."""
    largest: dict[str, Any] | None = None
    """The process holding the most private memory."""
    device: dict[str, Any] | None = None
    """``attribution``: the device split by owner, where NVML gives it."""


@dataclass(frozen=True, kw_only=True)
class KilledEvent(Event):
    """A rank died by a signal it did not raise itself (written by the launcher, ``rankmem train``)."""

    kind: str = field(default=KILLED, init=False)
    pid: int | None = None
    signal: str | None = None
    """``SIGKILL``, ``SIGTERM``, ..."""
    exitcode: int | None = None
    cause: str | None = None
    """``oom_killer`` where the OOM-kill counter of the rank's own cgroup rose, else ``unknown``."""
    last_rss_bytes: int | None = None
    """RSS at the rank's last heartbeat."""
    heartbeat_time: float | None = None
    cgroup_oom_kills: list[int | None] | None = None
    """The cgroup's OOM-kill counter before and after the job."""
    node_oom_kills: list[int | None] | None = None
    """The node's OOM-kill counter before and after the job."""
    source: str | None = None


@dataclass(frozen=True, kw_only=True)
class StalledEvent(Event):
    """A rank stopped making progress while the others went on (written by the launcher)."""

    kind: str = field(default=STALLED, init=False)
    pid: int | None = None
    heartbeat_age_s: float | None = None
    heartbeat_seq: int | None = None
    ahead_seq: int | None = None
    """The furthest sequence number any rank reached."""
    collect_marks: int | None = None
    ahead_marks: int | None = None
    process_state: str | None = None
    """The scheduler state last seen (``T``, ``t``, ``D``...), None where never sampled."""
    last_rss_bytes: int | None = None
    source: str | None = None


_BY_KIND: dict[str, type[Event]] = {OOM: OomEvent, NEAR_OOM: NearOomEvent, KILLED: KilledEvent, STALLED: StalledEvent}

# Per kind, how each of its own fields is read.
_CONVERT: dict[type[Event], dict[str, Any]] = {
    Event: {},
    OomEvent: {"where": as_str, "error": as_str, "requested_bytes": as_bytes, "error_total_bytes": as_bytes,
               "error_free_bytes": as_bytes, "host": as_object, "device": as_object, "observer": as_object,
               "snapshot": as_str},
    NearOomEvent: {"reasons": as_strings, "cgroup": as_object, "node": as_object, "pressure": as_object,
                   "processes": as_list, "largest": as_object, "device": as_object},
    KilledEvent: {"pid": as_int, "signal": as_str, "exitcode": as_int, "cause": as_str, "last_rss_bytes": as_bytes,
                  "heartbeat_time": as_float, "cgroup_oom_kills": _as_counts, "node_oom_kills": _as_counts,
                  "source": as_str},
    StalledEvent: {"pid": as_int, "heartbeat_age_s": as_float, "heartbeat_seq": as_int, "ahead_seq": as_int,
                   "collect_marks": as_int, "ahead_marks": as_int, "process_state": as_str,
                   "last_rss_bytes": as_bytes, "source": as_str},
}


def parse_event(obj: Mapping[str, Any]) -> Event | None:
    """The typed event of one line's object; None when it is no event (no ``kind`` string).

    A field that is absent gets its default; one of the wrong type gets its default too, its value kept
    in :attr:`Event.unread`; unknown fields go to :attr:`Event.extra`. Never raises.
    """
    kind = obj.get("kind")
    if not isinstance(kind, str):
        return None
    cls = _BY_KIND.get(kind, Event)
    read = Fields(obj)
    read.skip("kind")
    values: dict[str, Any] = {
        "rank": read.optional("rank", as_int), "step": read.optional("step", as_int),
        "phase": read.optional("phase", as_str), "time": read.optional("time", as_float),
        # A run id is hex digits of one length: anything else is no run's (and not an unread figure).
        "run_id": valid_run_id(obj.get(RUN_ID_FIELD)),
    }
    read.skip(RUN_ID_FIELD)
    defaults = {f.name: f.default for f in fields(cls)}
    for name, convert in _CONVERT[cls].items():
        values[name] = read.take(name, convert, defaults[name])
    if cls is Event:
        values["kind"] = kind
    return cls(**values, extra=read.extra(), unread=read.unread)
