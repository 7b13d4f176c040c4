"""Typed events both ways: each kind built by its real writer, appended by ``EventWriter``, read back by
``read_events`` into an equal record; damaged fields give their defaults (the value kept), unknown
fields and kinds are kept, and a damaged event costs no other event."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from rankmem.cli._diagnose import OomKills, diagnose
from rankmem.core.events import Event, KilledEvent, NearOomEvent, OomEvent, StalledEvent, parse_event
from rankmem.forensics.events import EventWriter, oom_event
from rankmem.forensics.heartbeat import HeartbeatRecord
from rankmem.offline.events import read_events
from rankmem.offline.report import describe_event

RUN_ID = "00112233445566ff"
GIB = 2**30
NOW = 1.75e9 + 100


def _beat(rank: int, pid: int, step: int, phase: str, seq: int, age: float) -> HeartbeatRecord:
    return HeartbeatRecord(rank=rank, pid=pid, step=step, phase=phase, rss_bytes=3 * GIB, time=NOW - age, seq=seq,
                           clean=False, run_id=RUN_ID, marks=seq // 4)


def _written(tmp_path: Path) -> list[Event]:
    """One event of each kind, as the real writers build them, appended by rank 1's writer."""
    oom = oom_event(MemoryError("Tried to allocate 2.00 GiB"), 1, 7, "update", {"rss_bytes": 5 * GIB}, None)
    near = NearOomEvent(rank=1, step=8, phase="rollout", time=NOW - 10, reasons=("node_available",),
                        node={"total_bytes": 16 * GIB, "available_bytes": GIB, "threshold_bytes": 2 * GIB},
                        processes=[{"pid": 4242, "rank": 1, "uss_bytes": 3 * GIB}])
    beats = {0: _beat(0, 9903, 161, "update", seq=486, age=31.0), 1: _beat(1, 9904, 161, "log_prob", seq=485, age=40.2)}
    (stalled,) = diagnose("", beats, OomKills(0, 0), OomKills(0, 0), NOW)
    killed = KilledEvent(rank=1, step=9, phase="update", time=NOW + 1, pid=9904, signal="SIGKILL", exitcode=-9,
                         cause="oom_killer", last_rss_bytes=3 * GIB, heartbeat_time=NOW,
                         cgroup_oom_kills=[0, 1], node_oom_kills=[None, None], source="launcher")
    future = Event(kind="gpu_reset", rank=1, step=10, time=NOW + 2, extra={"bus_id": "0000:3b:00.0"})
    written = [oom, near, stalled.event, killed, future]
    writer = EventWriter(str(tmp_path), 1, RUN_ID)
    for event in written:
        assert writer.write(event)
    writer.close()
    return [replace(e, run_id=RUN_ID) for e in written]


def test_each_kind_reads_back_as_the_record_its_writer_built(tmp_path: Path) -> None:
    written = _written(tmp_path)
    got = read_events(str(tmp_path), RUN_ID)
    assert got.corrupt == 0 and got.foreign == 0
    assert sorted(got.events, key=lambda e: e.kind) == sorted(written, key=lambda e: e.kind)
    by_kind = {e.kind: e for e in got.events}
    oom = by_kind["oom"]
    assert isinstance(oom, OomEvent) and oom.where == "host" and oom.requested_bytes == 2 * GIB
    assert oom.host == {"rss_bytes": 5 * GIB} and oom.rank == 1 and oom.step == 7
    stalled = by_kind["stalled"]
    assert isinstance(stalled, StalledEvent) and stalled.pid == 9904 and stalled.heartbeat_seq == 485
    assert stalled.heartbeat_age_s == pytest.approx(40.2) and stalled.ahead_seq == 486
    assert isinstance(by_kind["near_oom"], NearOomEvent) and by_kind["near_oom"].reasons == ("node_available",)
    assert isinstance(by_kind["killed"], KilledEvent) and by_kind["killed"].node_oom_kills == [None, None]
    future = by_kind["gpu_reset"]
    assert type(future) is Event and future.extra == {"bus_id": "0000:3b:00.0"}


def test_the_line_holds_the_fields_as_named_in_the_design(tmp_path: Path) -> None:
    _written(tmp_path)
    first = json.loads((tmp_path / "events" / "rank1.jsonl").read_text().splitlines()[0])
    assert {"kind", "rank", "step", "phase", "time", "run_id"} <= set(first)
    assert first["kind"] == "oom" and first["where"] == "host" and first["run_id"] == RUN_ID
    assert "extra" not in first and "unread" not in first


def _read_one(tmp_path: Path, line: str) -> Event:
    """``line`` between two whole events: it must not cost them."""
    events = tmp_path / "events"
    events.mkdir()
    (events / "rank0.jsonl").write_text(
        '{"kind":"oom","rank":0,"step":1,"time":1.0,"where":"host"}\n' + line + "\n"
        + '{"kind":"killed","rank":0,"step":3,"time":3.0,"signal":"SIGKILL"}\n')
    got = read_events(str(tmp_path))
    assert got.corrupt == 0 and len(got.events) == 3
    whole = [e for e in got.events if e.time in (1.0, 3.0)]
    assert [(type(e), e.step) for e in whole] == [(OomEvent, 1), (KilledEvent, 3)]
    (event,) = [e for e in got.events if e not in whole]
    return event


def test_missing_fields_read_as_their_defaults(tmp_path: Path) -> None:
    event = _read_one(tmp_path, '{"kind":"oom"}')
    assert event == OomEvent()
    assert (event.rank, event.step, event.phase, event.time, event.where, event.host) == (None, None, None, None,
                                                                                          "unknown", None)
    assert describe_event(event) == "oom rank None step None phase -: unknown"


@pytest.mark.parametrize(("line", "name", "raw"), [
    ('{"kind":"oom","rank":"one","time":2.0}', "rank", "one"),
    ('{"kind":"oom","rank":0,"step":2.5,"time":2.0}', "step", 2.5),
    ('{"kind":"oom","rank":0,"step":true,"time":2.0}', "step", True),
    ('{"kind":"oom","rank":0,"phase":["update"],"time":2.0}', "phase", ["update"]),
    ('{"kind":"oom","rank":0,"time":2.0,"host":[1]}', "host", [1]),
    ('{"kind":"oom","rank":0,"time":2.0,"requested_bytes":"2 GiB"}', "requested_bytes", "2 GiB"),
    ('{"kind":"near_oom","rank":0,"time":2.0,"reasons":7}', "reasons", 7),
    ('{"kind":"stalled","rank":0,"time":2.0,"heartbeat_age_s":NaN}', "heartbeat_age_s", math.nan),
    ('{"kind":"killed","rank":0,"time":2.0,"cgroup_oom_kills":["a",1]}', "cgroup_oom_kills", ["a", 1]),
    ('{"kind":"oom","rank":' + "9" * 40 + ',"time":2.0}', "rank", int("9" * 40)),
])
def test_a_wrong_typed_field_reads_as_its_default_and_is_kept(tmp_path: Path, line: str, name: str,
                                                              raw: object) -> None:
    event = _read_one(tmp_path, line)
    default = getattr(type(event)(), name)
    assert getattr(event, name) == default
    kept = event.unread[name]
    assert kept == raw or (isinstance(raw, float) and math.isnan(raw) and math.isnan(kept))
    assert event.to_json()[name] is kept  # report --json shows what the line held
    describe_event(event)  # one line, no traceback


def test_a_nan_time_reads_as_no_time_and_sorts_last(tmp_path: Path) -> None:
    events = tmp_path / "events"
    events.mkdir()
    (events / "rank0.jsonl").write_text('{"kind":"oom","rank":0,"step":9,"time":NaN}\n'
                                        '{"kind":"oom","rank":0,"step":1,"time":1.0}\n')
    got = read_events(str(tmp_path))
    assert [(e.step, e.time) for e in got.events] == [(1, 1.0), (9, None)]


def test_a_bad_value_is_shown_as_the_line_held_it() -> None:
    event = parse_event({"kind": "killed", "rank": "r1", "signal": 9, "cause": "oom_killer"})
    assert isinstance(event, KilledEvent) and event.rank is None and event.signal is None
    assert describe_event(event) == "killed rank r1 step None phase -: killed by 9; cause oom_killer"


def test_byte_counts_written_as_whole_floats_are_bytes() -> None:
    event = parse_event({"kind": "oom", "requested_bytes": 2.0 * GIB, "error_free_bytes": 1.5})
    assert isinstance(event, OomEvent) and event.requested_bytes == 2 * GIB and event.error_free_bytes is None
    assert event.unread == {"error_free_bytes": 1.5}


def test_unknown_fields_of_a_known_kind_are_kept_in_extra() -> None:
    event = parse_event({"kind": "oom", "rank": 0, "where": "device", "numa_node": 1, "run_id": RUN_ID})
    assert isinstance(event, OomEvent) and event.extra == {"numa_node": 1} and event.run_id == RUN_ID
    assert event.to_json()["numa_node"] == 1


@pytest.mark.parametrize("line", ['{"kind":7,"rank":0}', '{"rank":0}', '["oom"]', '"oom"'])
def test_a_line_without_a_kind_string_is_no_event_and_counted(tmp_path: Path, line: str) -> None:
    events = tmp_path / "events"
    events.mkdir()
    (events / "rank0.jsonl").write_text(line + '\n{"kind":"oom","rank":0,"step":1,"time":1.0}\n')
    got = read_events(str(tmp_path))
    assert got.corrupt == 1 and [e.step for e in got.events] == [1]
