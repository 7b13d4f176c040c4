"""Per-rank heartbeat: the last step, phase and RSS of each rank, in a tiny file the launcher can read
after the rank is gone.

A rank killed by SIGKILL (the kernel OOM killer's signal) runs no code, so what it was doing must
already be in the file: each window edge overwrites one fixed-size binary record in ``<dir>/rank<r>.hb``
through a shared memory map of the file (``os.pwrite`` where the file cannot be mapped), storing only the
fields that move; the page cache keeps the record after the process. The launcher sets
``RANKMEM_HEARTBEAT_DIR``; a rank whose sequence counter stopped while the others moved on is the one
that hung.

Record layout (little-endian, :data:`RECORD_SIZE` bytes; version 3 appends to version 2's)::

    magic b"RMHB", version u16, flags u16 (bit 0: clean exit, bit 1: inside a collect), pid u32,
    rank i32, seq u64, step i64 (-2**63: none yet; a step may be negative), rss i64 (-1: unknown),
    time f64 (Unix seconds), phase 32 bytes (UTF-8, NUL-padded, truncated), seq u64 again,
    run id 16 ASCII bytes (:mod:`rankmem.core.rundir`), collect marks u64, host_pid u32 (0: not mapped),
    boot_id 16 bytes (zeros: unknown), seq u64 a third time

``seq`` repeats so that a reader can tell a record read mid-write (it reads again after a pause; one
that stays so is torn: :attr:`HeartbeatRecord.torn`). ``collect marks`` count the collect edges passed
(entering collect k makes it 2k+1, leaving it 2k+2), so a rank stopped before ``collect()`` is told from
one waiting inside it. The host PID and the node's boot id let device attribution match only ranks of
this node. The file's blocks are allocated before it is mapped (a store into a hole on a full file
system is SIGBUS), and numbers read back are bounded before use.
"""

from __future__ import annotations

import errno
import glob
import math
import mmap
import os
import struct
import time
from dataclasses import dataclass
from time import time as _now

from rankmem.core.rundir import (
    HEARTBEAT_DIR,
    RUN_ID_BYTES,
    RunDir,
    head,
    open_regular,
    valid_run_id,
)
from rankmem.core.warnings import WarnOnce
from rankmem.probe import procfs as _procfs

__all__ = ["ENV_DIR", "HEARTBEAT_DIR", "Heartbeat", "HeartbeatRecord", "heartbeat_dir", "heartbeat_path",
           "read_heartbeats"]

ENV_DIR = "RANKMEM_HEARTBEAT_DIR"
MAGIC = b"RMHB"
VERSION = 3
NO_STEP = -(2**63)
"""The step field before the first step (version 1 used -1, which hid negative steps)."""
PHASE_BYTES = 32
_CLEAN = 1
_COLLECTING = 2
_V2 = struct.Struct(f"<4sHHIiQqqd{PHASE_BYTES}sQ")
_TAIL = struct.Struct(f"<{RUN_ID_BYTES}sQI16sQ")  # run id, marks, host_pid, boot_id, seq
_RECORD = struct.Struct(_V2.format + _TAIL.format[1:])
RECORD_SIZE = _RECORD.size
# A beat changes only seq, step, rss, time and phase, and the two later copies of seq: it stores those
# fields one by one through typed views of the map, the last copy first, then the middle one, the fields,
# and the first copy last. A reader copies the record in ascending order (first copy, fields, the later
# copies): where it saw any field of the new beat, it then sees the later copies new too, and the first
# copy old or new as it read it; the three agree only where it saw one beat whole. Item stores are
# cheaper than a ``pack_into`` of the record on a cold interpreter. A writer killed between its stores
# leaves a torn record, which the reader keeps (see :func:`unpack_record`).
_BEAT_AT = struct.calcsize("<4sHHIi")
_STEP_AT, _RSS_AT, _TIME_AT, _PHASE_AT = _BEAT_AT + 8, _BEAT_AT + 16, _BEAT_AT + 24, _BEAT_AT + 32
_SEQ2_AT, _SEQ3_AT = _PHASE_AT + PHASE_BYTES, RECORD_SIZE - 8
assert _BEAT_AT % 8 == 0 and _SEQ2_AT == _V2.size - 8 and _SEQ2_AT % 8 == 0, "the views' items are aligned"
# Their indices in the 8-byte views, worked out once (not a division per store on the training thread).
_SEQ_I, _STEP_I, _RSS_I, _TIME_I, _SEQ2_I = (at // 8 for at in (_BEAT_AT, _STEP_AT, _RSS_AT, _TIME_AT, _SEQ2_AT))
RUN_ID_AT = _V2.size
"""Where a heartbeat record holds its run id (bytes): what rotation reads (:func:`heartbeat_run_id`)."""
MAX_RANK = 1 << 24
"""A rank read from a file beyond this is damage, not a rank (16M ranks: past any cluster)."""
_NO_RUN = b"\0" * RUN_ID_BYTES
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def heartbeat_run_id(path: str) -> str | None:
    """The run id a heartbeat file holds; None when it has none or cannot be read (rotation's reader)."""
    data = head(path, RUN_ID_AT + RUN_ID_BYTES)
    if data is None or len(data) < RUN_ID_AT + RUN_ID_BYTES:
        return None
    try:
        return valid_run_id(data[RUN_ID_AT:].decode("ascii"))
    except UnicodeDecodeError:
        return None


def boot_id(path: str = BOOT_ID) -> bytes:
    """This machine's boot id (16 bytes; zeros where unreadable): equal on the ranks of one node."""
    try:
        with open(path, "rb") as f:
            return bytes.fromhex(f.read(64).decode("ascii").strip().replace("-", ""))[:16].ljust(16, b"\0")
    except (OSError, ValueError):
        return bytes(16)


def heartbeat_dir(out_dir: str | None) -> str | None:
    """Where this rank's heartbeat goes: ``$RANKMEM_HEARTBEAT_DIR`` when the launcher set it, else
    ``<out_dir>/heartbeat``; None (no heartbeat) without either."""
    env = os.environ.get(ENV_DIR)
    if env:
        return env
    return RunDir(out_dir).heartbeat if out_dir else None


def heartbeat_path(directory: str, rank: int) -> str:
    return RunDir(os.path.dirname(directory)).heartbeat_file(rank, directory)


def _phase_bytes(phase: str | None) -> bytes:
    raw = (phase or "").encode("utf-8")[:PHASE_BYTES]
    # Never cut a multi-byte character in half: drop the partial tail. NUL-padded to the field: a beat
    # stores it whole, over a longer phase's bytes.
    return raw.decode("utf-8", "ignore").encode("utf-8").ljust(PHASE_BYTES, b"\0")


@dataclass(frozen=True, slots=True)
class HeartbeatRecord:
    """A rank's last heartbeat."""

    pid: int
    rank: int
    step: int | None
    """The step of the last window edge; None before the first step."""
    phase: str
    """The innermost open phase at that edge ("" outside any phase)."""
    rss_bytes: int | None
    time: float
    """Wall time of the last beat (Unix seconds)."""
    seq: int
    """Beats so far: every rank beats at the same edges, so a rank whose count lags stopped early."""
    clean: bool
    """The rank closed its heartbeat: it exited normally, not by a signal."""
    run_id: str | None = None
    """The run the beat belongs to (None: an older rankmem wrote it)."""
    host_pid: int | None = None
    """The rank's PID in the host's namespace, where it could see it; None: not mapped."""
    boot_id: bytes | None = None
    """The rank's node (its boot id); None where unknown."""
    marks: int = 0
    """Collect edges passed: 2k+1 inside collect k, 2k+2 after it (see the module docstring)."""
    torn: bool = False
    """The writer stopped between a beat's stores (killed, or frozen, mid-beat): step, phase, RSS and time
    are each its last whole beat's or the next one's, and ``seq`` counts the whole beats."""

    @property
    def collecting(self) -> bool:
        """The rank was inside a collect (entered, not yet left) at its last beat."""
        return self.marks % 2 == 1

    @property
    def progress(self) -> tuple[int, int]:
        """What orders ranks by how far they got: collect edges first, then window edges."""
        return (self.marks, self.seq)


class Heartbeat:
    """This rank's heartbeat file, held open for the life of the run; never raises.

    The first record is written at construction (step None), so the launcher can map the rank's pid to its
    rank even when it dies before its first step. A file that cannot be made gives one warning.
    """

    def __init__(self, directory: str, rank: int, run_id: str | None = None, host_pid: int | None = None) -> None:
        self._host_pid = host_pid or 0
        self._boot = boot_id()
        self.path = heartbeat_path(directory, rank)
        self._rank = rank
        self._pid = os.getpid()
        self._seq = 0
        self._marks = 0
        self._step = NO_STEP
        self._phase = b""
        self._phase_name: str | None = None
        self._rss = -1
        self._run = _run_bytes(run_id)
        self._warn_once = WarnOnce()
        self._map: mmap.mmap | None = None
        self._views: _Views | None = None
        self._fd = self._open(directory)
        if self._fd is not None:
            self._write(0)  # the first pwrite: where the disk refuses, no map is made over a hole
        if self._fd is not None:
            try:
                self._map = mmap.mmap(self._fd, RECORD_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError):
                self._map = None  # a file system that cannot map files: every beat is a pwrite
            else:
                self._views = _Views(self._map)

    def _open(self, directory: str) -> int | None:
        try:
            os.makedirs(directory, exist_ok=True)
            fd = open_regular(self.path, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            self._warn_once("heartbeat", f"cannot write the heartbeat {self.path} ({exc}); the launcher "
                                         "will not know this rank's last step")
            return None
        try:
            os.ftruncate(fd, RECORD_SIZE)  # an older, longer record: the same size as this one's
            os.posix_fallocate(fd, 0, RECORD_SIZE)  # its blocks, now: a mapped store cannot fault later
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):  # NFS: the pwrite allocates
                os.close(fd)
                self._warn_once("heartbeat", f"cannot write the heartbeat {self.path} ({exc}); the launcher "
                                             "will not know this rank's last step")
                return None
        return fd

    def adopt(self, run_id: str | None) -> None:
        """Carry ``run_id`` from now on (the run's id, learnt at the first collect)."""
        self._run = _run_bytes(run_id)
        self._write(0)  # the whole record: a beat stores only the fields that move

    def edge(self, step: int | None, phase: str | None, rss: int | None, failing: bool = False) -> None:
        """Record a window edge: ``step`` (None before the first), the innermost open ``phase``, and this
        process's RSS in bytes (None when unknown). A ``WindowListener.edge``: on the host alone, where an
        edge is nothing but its heartbeat, Forensics hands this method to the windows itself, a Python
        call less on each of the training thread's edges. Stores into the mapped record, field by field
        (see :data:`_BEAT_AT`; the header was written whole when it changed)."""
        self._seq = seq = self._seq + 1
        self._step = step = NO_STEP if step is None else step
        self._rss = rss = -1 if rss is None else rss
        views = self._views
        if views is None:
            if phase != self._phase_name:
                self._phase_name, self._phase = phase, _phase_bytes(phase)
            self._write(0)
            return
        words = views.words
        views.last[0] = seq  # the later copies first, the first copy last: see _BEAT_AT
        words[_SEQ2_I] = seq
        words[_STEP_I] = step
        words[_RSS_I] = rss
        views.floats[_TIME_I] = _now()
        if phase != self._phase_name:  # most edges repeat the last phase: encode and store it once
            self._phase_name = phase
            self._phase = views.raw[_PHASE_AT : _PHASE_AT + PHASE_BYTES] = _phase_bytes(phase)
        words[_SEQ_I] = seq

    beat = edge

    def collect_edge(self) -> None:
        """Entering or leaving a collect (they alternate): see the module docstring."""
        self._marks += 1
        self._write(0)

    def close(self, clean: bool = True) -> None:
        """Mark the exit (``clean``: a normal one) and close the file; later beats are dropped."""
        self._write(_CLEAN if clean else 0)
        if self._views is not None:
            self._views.release()  # the map cannot close while views of it exist
            self._views = None
        if self._map is not None:
            self._map.close()
            self._map = None
        _procfs.close_fd(self._fd)
        self._fd = None

    def _fields(self, flags: int) -> tuple[object, ...]:
        flags |= _COLLECTING if self._marks % 2 else 0
        return (MAGIC, VERSION, flags, self._pid, self._rank, self._seq, self._step, self._rss, time.time(),
                self._phase, self._seq, self._run, self._marks, self._host_pid, self._boot, self._seq)

    def _write(self, flags: int) -> None:
        if self._map is not None:
            _RECORD.pack_into(self._map, 0, *self._fields(flags))
            return
        if self._fd is None:
            return
        try:
            os.pwrite(self._fd, _RECORD.pack(*self._fields(flags)), 0)
        except OSError as exc:
            self._warn_once("heartbeat", f"cannot write the heartbeat {self.path} ({exc}); heartbeats stop")
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


class _Views:
    """Typed views of the mapped record that a beat stores through: 64-bit words (seq, step, RSS and the
    second seq), doubles (time), the raw bytes (phase), and the last seq, which is not word-aligned."""

    __slots__ = ("raw", "words", "floats", "last")

    def __init__(self, mapped: mmap.mmap) -> None:
        self.raw = memoryview(mapped)
        aligned = self.raw[: _SEQ2_AT + 8]
        self.words = aligned.cast("q")
        self.floats = aligned.cast("d")
        self.last = self.raw[_SEQ3_AT : _SEQ3_AT + 8].cast("q")

    def release(self) -> None:
        for view in (self.last, self.floats, self.words, self.raw):
            view.release()


def _run_bytes(run_id: str | None) -> bytes:
    valid = valid_run_id(run_id)
    return _NO_RUN if valid is None else valid.encode("ascii")


def unpack_record(data: bytes, torn: bool = False) -> HeartbeatRecord | None:
    """The record in ``data``, or None for a short, foreign, newer-version or damaged one (a rank, pid or
    time no process could have written). A half-written one (its seq copies disagree) is None too,
    unless ``torn``: then it is read as :attr:`HeartbeatRecord.torn` (the reader's last try, when the
    writer has not finished the beat since: it stopped in the middle)."""
    if len(data) < _V2.size:
        return None
    magic, version, flags, pid, rank, seq, step, rss, t, phase, seq2 = _V2.unpack_from(data)
    if magic != MAGIC or version not in (1, 2, VERSION):
        return None
    run_id, marks, host_pid, node = None, 0, None, None
    seqs = {seq, seq2}
    if version == VERSION:
        if len(data) < RECORD_SIZE:
            return None
        raw_run, marks, host, raw_node, seq3 = _TAIL.unpack_from(data, _V2.size)
        seqs.add(seq3)
        run_id = valid_run_id(raw_run.decode("ascii", "replace"))
        host_pid, node = host or None, raw_node if any(raw_node) else None
    # A beat stores the later copies first and the first copy last: in a torn one they are one beat ahead.
    if len(seqs) > 1 and not (torn and len(seqs) == 2 and max(seqs) - min(seqs) == 1 and seq == min(seqs)):
        return None
    seq = min(seqs)
    if not 0 <= rank < MAX_RANK or pid == 0 or not math.isfinite(t):
        return None
    # Version 1 (a rank of an older rankmem on another node) wrote -1 for "no step yet".
    none = step == NO_STEP or (version == 1 and step < 0)
    return HeartbeatRecord(pid=pid, rank=rank, step=None if none else step,
                           phase=phase.rstrip(b"\0").decode("utf-8", "replace"),
                           rss_bytes=None if rss < 0 else rss, time=t, seq=seq, clean=bool(flags & _CLEAN),
                           run_id=run_id, marks=marks, host_pid=host_pid, boot_id=node, torn=len(seqs) > 1)


RETRY_PAUSES_S = (0.0005, 0.002, 0.01)
"""The pauses before reading a half-written record again (the last read keeps it, as torn): ~13 ms in all,
a scheduler's time slice or two, for a writer preempted between a beat's stores to finish it."""


def _half_written(data: bytes) -> bool:
    """``data`` is a heartbeat record of a known version whose seq copies alone disagree (a beat was under
    way as it was read), not garbage or another format."""
    if len(data) < _V2.size or data[:4] != MAGIC:
        return False
    return unpack_record(data, torn=True) is not None


MAX_FILES = 1 << 16
"""Heartbeat files read from one directory at most (a damaged or foreign directory bounds the work)."""


def read_heartbeats(directory: str, run_id: str | None = None) -> dict[int, HeartbeatRecord]:
    """Every readable ``rank*.hb`` in ``directory`` by rank; short, garbage, unreadable and non-regular
    files (a FIFO: never opened blocking) are skipped, and a missing directory is no heartbeats.
    ``run_id``: only that run's records (another run's are foreign, not this run's ranks)."""
    out: dict[int, HeartbeatRecord] = {}
    for path in glob.glob(os.path.join(glob.escape(directory), "rank*.hb"))[:MAX_FILES]:
        record = None
        for pause in (*RETRY_PAUSES_S, None):
            try:
                fd = open_regular(path, os.O_RDONLY)
            except OSError:
                break
            try:
                data = os.pread(fd, RECORD_SIZE, 0)
            except OSError:
                break
            finally:
                os.close(fd)
            record = unpack_record(data, torn=pause is None)
            if record is not None or pause is None or not _half_written(data):
                break  # read whole, or garbage: reading garbage again gives the same garbage
            # The seq copies disagree: a beat was under way. Its stores take ~1 us, but a writer descheduled
            # between them (a loaded node) finishes only when it runs again: pause, then read again.
            time.sleep(pause)
        # A record is another process's bytes: its rank must be the one its name says (rank 2**31 once
        # asked watch for two billion rows) and its time a time.
        if record is not None and (run_id is None or record.run_id == run_id) \
                and os.path.basename(path) == f"rank{record.rank}.hb" and math.isfinite(record.time):
            out[record.rank] = record
    return out


def node_siblings(directory: str | None, rank: int, translated: bool,
                  local_world: int | None = None) -> tuple[set[int], str | None]:
    """The PIDs of this node's other live ranks, by their heartbeats: host PIDs (their namespace's
    when ``translated``), and why some are unknown (None when every one is known). ``local_world``:
    how many ranks this node runs (torchrun's ``LOCAL_WORLD_SIZE``, read when not given)."""
    if local_world is None:
        local_world = _env_int("LOCAL_WORLD_SIZE")
    if directory is None:
        if local_world in (None, 1) and _env_int("WORLD_SIZE") in (None, 1):
            return set(), None  # a single process: no sibling to look for
        return set(), "no heartbeats to find the sibling ranks by (no out_dir)"
    here = boot_id()
    if not any(here):
        return set(), f"this node's boot id ({BOOT_ID}) is unreadable: sibling ranks cannot be told apart"
    pids: set[int] = set()
    unknown: list[int] = []
    found = 0
    for other, record in read_heartbeats(directory).items():
        if other == rank or record.clean or record.boot_id != here:
            continue  # itself, a rank that has exited, or a rank of another node
        found += 1
        pid = record.pid if translated else record.host_pid
        if pid is None:
            unknown.append(other)
        else:
            pids.add(pid)
    if unknown:
        return pids, f"the host PID of rank(s) {', '.join(map(str, sorted(unknown)))} is unknown (its /proc shows none)"
    if local_world is not None and found < local_world - 1:
        return pids, f"{found} of this node's {local_world - 1} other rank(s) have a heartbeat yet"
    return pids, None


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None
