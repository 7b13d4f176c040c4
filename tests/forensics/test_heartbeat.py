"""Heartbeat files: the fixed record round-trips, survives the process, and bad files are skipped."""

from __future__ import annotations

import itertools
import os
import struct
import time
import types
from pathlib import Path

import pytest

from rankmem.forensics import heartbeat as _heartbeat
from rankmem.forensics.heartbeat import RECORD_SIZE, Heartbeat, heartbeat_dir, read_heartbeats


def test_beat_round_trip(tmp_path: Path) -> None:
    before = time.time()
    hb = Heartbeat(str(tmp_path), 1)
    first = read_heartbeats(str(tmp_path))[1]
    assert first.pid == os.getpid() and first.step is None and first.seq == 0 and not first.clean
    hb.beat(57, "update", 3 << 30)
    hb.beat(58, "rollout", None)
    rec = read_heartbeats(str(tmp_path))[1]
    assert (rec.rank, rec.step, rec.phase, rec.rss_bytes, rec.seq, rec.clean) == (1, 58, "rollout", None, 2, False)
    assert before <= rec.time <= time.time()
    assert os.path.getsize(tmp_path / "rank1.hb") == RECORD_SIZE
    hb.close()
    rec = read_heartbeats(str(tmp_path))[1]
    assert rec.clean and rec.step == 58 and rec.seq == 2
    hb.beat(59, "x", 1)  # after close: dropped, no error
    assert read_heartbeats(str(tmp_path))[1].step == 58


def test_a_negative_step_reads_back_as_itself(tmp_path: Path) -> None:
    hb = Heartbeat(str(tmp_path), 0)
    hb.beat(-1, "validate", 1 << 30)  # an evaluation before training, numbered -1
    assert read_heartbeats(str(tmp_path))[0].step == -1
    hb.beat(None, None, None)
    assert read_heartbeats(str(tmp_path))[0].step is None
    hb.close()


def test_unclean_close_and_outliving_the_process(tmp_path: Path) -> None:
    pid = os.fork()
    if pid == 0:
        hb = Heartbeat(str(tmp_path), 2)
        hb.beat(12, "rollout", 1 << 20)
        os.kill(os.getpid(), 9)  # what the OOM killer does: no code runs after this
    os.waitpid(pid, 0)
    rec = read_heartbeats(str(tmp_path))[2]
    assert rec.pid == pid and rec.step == 12 and rec.phase == "rollout" and not rec.clean
    hb = Heartbeat(str(tmp_path), 3)
    hb.close(clean=False)
    assert not read_heartbeats(str(tmp_path))[3].clean


def test_phase_is_truncated_on_a_character_boundary(tmp_path: Path) -> None:
    hb = Heartbeat(str(tmp_path), 0)
    hb.beat(1, "p" * 31 + "é", None)  # "é" is 2 bytes and would straddle the 32-byte field
    assert read_heartbeats(str(tmp_path))[0].phase == "p" * 31
    hb.beat(2, "rollout/génération", None)
    assert read_heartbeats(str(tmp_path))[0].phase == "rollout/génération"


def test_short_garbage_and_torn_files_are_skipped(tmp_path: Path) -> None:
    Heartbeat(str(tmp_path), 0).beat(5, "a", 1)
    (tmp_path / "rank1.hb").write_bytes(b"RMHB")  # short
    (tmp_path / "rank2.hb").write_bytes(os.urandom(RECORD_SIZE))  # garbage
    good = (tmp_path / "rank0.hb").read_bytes()
    (tmp_path / "rank3.hb").write_bytes(good[:-8] + struct.pack("<Q", 99))  # seq halves disagree: torn
    (tmp_path / "rank4.hb").write_bytes(good[:4] + struct.pack("<H", 99) + good[6:])  # a newer version
    (tmp_path / "notes.txt").write_text("x")
    assert list(read_heartbeats(str(tmp_path))) == [0]
    assert read_heartbeats(str(tmp_path / "missing")) == {}


def test_unwritable_directory_warns_and_beats_are_no_ops(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.warns(RuntimeWarning, match="cannot write the heartbeat"):
        hb = Heartbeat(str(blocker / "hb"), 0)
    hb.beat(1, "a", 1)
    hb.close()


def test_heartbeat_dir_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_heartbeat.ENV_DIR, raising=False)
    assert heartbeat_dir(str(tmp_path)) == str(tmp_path / "heartbeat")
    assert heartbeat_dir(None) is None
    monkeypatch.setenv(_heartbeat.ENV_DIR, "/launcher/hb")
    assert heartbeat_dir(str(tmp_path)) == "/launcher/hb"
    assert heartbeat_dir(None) == "/launcher/hb"


def test_a_file_that_cannot_be_mapped_is_written_with_pwrite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_map(*args: object) -> None:
        raise OSError(19, "No such device")  # ENODEV: what mmap gives on a file system without it

    monkeypatch.setattr(_heartbeat.mmap, "mmap", no_map)
    hb = Heartbeat(str(tmp_path), 4)
    hb.beat(7, "update", 5 << 20)
    rec = read_heartbeats(str(tmp_path))[4]
    assert (rec.step, rec.phase, rec.rss_bytes, rec.seq, rec.clean) == (7, "update", 5 << 20, 1, False)
    hb.close()
    assert read_heartbeats(str(tmp_path))[4].clean
    assert os.path.getsize(tmp_path / "rank4.hb") == RECORD_SIZE


def test_a_version_1_record_still_reads(tmp_path: Path) -> None:
    """A rank of the previous release (another node, mid-upgrade) wrote version 1, with -1 for no step."""
    hb = Heartbeat(str(tmp_path), 3)
    hb.beat(12, "update", 1 << 30)
    hb.close()
    path = tmp_path / "rank3.hb"
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, 4, 1)  # the version field, after the 4-byte magic
    path.write_bytes(bytes(data))
    assert read_heartbeats(str(tmp_path))[3].step == 12
    step_at = struct.calcsize("<4sHHIiQ")
    struct.pack_into("<q", data, step_at, -1)
    path.write_bytes(bytes(data))
    assert read_heartbeats(str(tmp_path))[3].step is None


def test_version_3_records_the_host_pid_and_the_node(tmp_path: Path) -> None:
    hb = Heartbeat(str(tmp_path), 0, host_pid=123456)
    hb.beat(4, "rollout", 1)
    record = read_heartbeats(str(tmp_path))[0]
    assert record.host_pid == 123456 and record.pid == os.getpid()
    assert record.boot_id == _heartbeat.boot_id() and record.boot_id is not None and any(record.boot_id)
    Heartbeat(str(tmp_path), 1).beat(1, None, None)  # a rank that cannot see its host PID
    assert read_heartbeats(str(tmp_path))[1].host_pid is None


def test_node_siblings_are_the_live_ranks_of_this_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    Heartbeat(str(tmp_path), 0, host_pid=100)
    Heartbeat(str(tmp_path), 1, host_pid=101)
    assert _heartbeat.node_siblings(str(tmp_path), 0, translated=False) == (
        {101}, "1 of this node's 2 other rank(s) have a heartbeat yet")
    Heartbeat(str(tmp_path), 2, host_pid=102).close()  # exited: no longer a sibling to look for
    gone = _heartbeat.node_siblings(str(tmp_path), 0, translated=False)
    assert gone == ({101}, "1 of this node's 2 other rank(s) have a heartbeat yet")
    Heartbeat(str(tmp_path), 2)  # back, without a host PID
    pids, why = _heartbeat.node_siblings(str(tmp_path), 0, translated=False)
    assert pids == {101} and why == "the host PID of rank(s) 2 is unknown (its /proc shows none)"
    # Translated: their namespace PIDs (in this test, all of them this process)
    assert _heartbeat.node_siblings(str(tmp_path), 0, translated=True) == ({os.getpid()}, None)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert _heartbeat.node_siblings(None, 0,
                                    translated=False)[1] == "no heartbeats to find the sibling ranks by (no out_dir)"


def test_a_beat_moves_its_own_fields_and_keeps_the_rest(tmp_path: Path) -> None:
    # A beat stores seq, step, rss, time and phase only: what adopt and collect_edge wrote stays.
    hb = Heartbeat(str(tmp_path), 0, host_pid=4242)
    hb.adopt("0123456789abcdef")
    hb.collect_edge()  # inside collect 0: marks 1, the collecting flag on
    hb.beat(3, "a-long-phase-name", 5 << 20)
    hb.beat(4, "up", 6 << 20)  # a shorter phase over a longer one: no tail of the old name left
    rec = read_heartbeats(str(tmp_path))[0]
    assert (rec.step, rec.phase, rec.rss_bytes, rec.seq) == (4, "up", 6 << 20, 2)
    assert (rec.run_id, rec.marks, rec.collecting, rec.host_pid) == ("0123456789abcdef", 1, True, 4242)
    hb.collect_edge()
    hb.beat(5, None, None)
    rec = read_heartbeats(str(tmp_path))[0]
    assert (rec.step, rec.phase, rec.rss_bytes, rec.seq, rec.marks, rec.collecting) == (5, "", None, 3, 2, False)
    hb.close()


def _regions() -> list[tuple[int, int]]:
    """The record's byte ranges as a beat touches them: header, seq, step, rss, time, phase, seq copy,
    tail, last seq copy (ascending, as a reader copies them)."""
    cuts = [0, _heartbeat._BEAT_AT, _heartbeat._STEP_AT, _heartbeat._RSS_AT, _heartbeat._TIME_AT,
            _heartbeat._PHASE_AT, _heartbeat._SEQ2_AT, _heartbeat._SEQ2_AT + 8, _heartbeat._SEQ3_AT, RECORD_SIZE]
    return list(zip(cuts, cuts[1:], strict=False))


class _Stores:
    """Stands in for the beat's views of the map and notes the offset of each store, in order."""

    def __init__(self, offsets: list[int], base: int = 0, item: int = 8) -> None:
        self.offsets, self.base, self.item = offsets, base, item

    def __setitem__(self, key: int | slice, value: object) -> None:
        start = key.start if isinstance(key, slice) else key * self.item
        self.offsets.append(self.base + start)


def _store_order() -> list[int]:
    """The offsets a real beat stores at, in the order it stores them (phase changing)."""
    offsets: list[int] = []
    views = types.SimpleNamespace(words=_Stores(offsets), floats=_Stores(offsets), raw=_Stores(offsets, item=1),
                                  last=_Stores(offsets, base=_heartbeat._SEQ3_AT))
    hb = Heartbeat.__new__(Heartbeat)
    hb._seq, hb._phase_name, hb._views = 0, None, views
    hb.edge(1, "p", 1)
    return offsets


def _writer_states(whole: bytes, after: bytes) -> list[bytes]:
    """The record after each store of the beat that turns ``whole`` into ``after``, in the order the
    writer stores (:func:`_store_order`)."""
    starts = {lo: (lo, hi) for lo, hi in _regions()}
    order = [starts[at] for at in _store_order()]
    moving = [r for i, r in enumerate(_regions()) if i not in (0, 7)]  # not the header, not the tail
    assert sorted(order) == moving, "a beat stores every moving field once, and nothing else"
    states, cur = [whole], bytearray(whole)
    for lo, hi in order:
        cur[lo:hi] = after[lo:hi]
        states.append(bytes(cur))
    assert states[-1] == after
    return states


def test_a_reader_racing_a_beat_sees_one_beat_whole_or_a_torn_one(tmp_path: Path) -> None:
    # A reader copies the record in ascending order while the writer stores a beat: every region it
    # copies comes from the record as it stood at some store, never earlier than the region before
    # it. Over every such read, what it takes for a whole record is one of the two beats.
    hb = Heartbeat(str(tmp_path), 0)
    hb.beat(1, "a" * 20, 1)
    whole = (tmp_path / "rank0.hb").read_bytes()
    hb.beat(2, "b", 2)
    after = (tmp_path / "rank0.hb").read_bytes()
    hb.close()
    beats = {(r.seq, r.step, r.phase, r.rss_bytes, r.time) for r in map(_heartbeat.unpack_record, (whole, after))
             if r is not None}
    assert len(beats) == 2
    states, regions = _writer_states(whole, after), _regions()
    seen = accepted = 0
    for picks in itertools.combinations_with_replacement(range(len(states)), len(regions)):
        read = b"".join(states[s][lo:hi] for s, (lo, hi) in zip(picks, regions, strict=True))
        record = _heartbeat.unpack_record(read)
        seen += 1
        if record is not None:
            accepted += 1
            assert (record.seq, record.step, record.phase, record.rss_bytes, record.time) in beats, picks
    assert seen > 10_000 and accepted > 0


def test_a_beat_caught_half_written_reads_as_torn(tmp_path: Path) -> None:
    # A record its writer left between a beat's stores (killed, or frozen, mid-beat) fails the
    # reader's tries and is read at the last one as torn: its seq the whole beats', each moving field
    # its last beat's or the next's. Never dropped.
    hb = Heartbeat(str(tmp_path), 0)
    hb.beat(1, "a", 1)
    whole = (tmp_path / "rank0.hb").read_bytes()
    hb.beat(2, "b", 2)
    after = (tmp_path / "rank0.hb").read_bytes()
    for half in _writer_states(whole, after)[1:-1]:
        assert _heartbeat.unpack_record(half) is None
        torn = _heartbeat.unpack_record(half, torn=True)
        assert torn is not None and (torn.seq, torn.torn) == (1, True)
        assert torn.step in (1, 2) and torn.phase in ("a", "b") and torn.rss_bytes in (1, 2)
        (tmp_path / "rank1.hb").write_bytes(half[:12] + struct.pack("<i", 1) + half[16:])  # as rank 1's file
        assert read_heartbeats(str(tmp_path))[1].torn
    record = _heartbeat.unpack_record(after)
    assert record is not None and (record.seq, record.torn, record.step, record.phase) == (2, False, 2, "b")
    # Copies two or more beats apart, or the first copy ahead of the later ones, are damage.
    assert _heartbeat.unpack_record(after[:-8] + struct.pack("<Q", 0), torn=True) is None
    at = _heartbeat._BEAT_AT
    assert _heartbeat.unpack_record(whole[:at] + after[at : at + 8] + whole[at + 8 :], torn=True) is None
    hb.close()


def test_a_beat_its_writer_finishes_while_the_reader_pauses_is_read_whole(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # A writer descheduled between a beat's stores finishes it when it runs again: the reader pauses
    # before its next try rather than spending its tries in a microsecond and calling the beat torn.
    hb = Heartbeat(str(tmp_path), 0)
    hb.beat(1, "a", 1)
    whole = (tmp_path / "rank0.hb").read_bytes()
    hb.beat(2, "b", 2)
    after = (tmp_path / "rank0.hb").read_bytes()
    hb.close()
    path = tmp_path / "rank0.hb"
    half = _writer_states(whole, after)[2]
    path.write_bytes(half)
    pauses: list[float] = []

    def the_writer_runs_again(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 2:  # after the reader's second try
            path.write_bytes(after)

    monkeypatch.setattr(_heartbeat.time, "sleep", the_writer_runs_again)
    record = read_heartbeats(str(tmp_path))[0]
    assert (record.seq, record.step, record.phase, record.torn) == (2, 2, "b", False)
    assert len(pauses) == 2 and all(p > 0 for p in pauses)
    # Garbage is read once: reading it again would give the same garbage, after a pause for nothing.
    pauses.clear()
    path.write_bytes(b"\xff" * len(after))
    assert read_heartbeats(str(tmp_path)) == {}
    assert pauses == []
    # Left half-written (the writer was killed mid-beat): every try, then kept as torn.
    path.write_bytes(half)
    monkeypatch.setattr(_heartbeat.time, "sleep", pauses.append)
    assert read_heartbeats(str(tmp_path))[0].torn
    assert pauses == list(_heartbeat.RETRY_PAUSES_S)
