"""Per-rank heartbeat: the last step, phase and RSS of each rank, in a tiny file the launcher can read
after the rank is gone.

A rank killed by SIGKILL (the kernel OOM killer's signal) runs no code, so what it was doing must
already be in the file: each window edge overwrites one fixed-size binary record in ``<dir>/rank<r>.hb``
through a shared memory map of the file (``os.pwrite`` where the file cannot be mapped). The page
cache holds the mapped page, so the record outlives the process. No system call: a ``pwrite`` costs
~1 us in a loop but ~40 us right after a training step's compute has pushed the kernel's paths out of
the caches, the store into the map ~20 us, most of it the cold interpreter (``bench/bench_cold.py``).
The launcher sets ``RANKMEM_HEARTBEAT_DIR`` so that it knows where to look; a rank whose sequence
counter stopped while the others moved on is the one that hung.

Record layout (little-endian, :data:`RECORD_SIZE` bytes)::

    magic b"RMHB", version u16, flags u16 (bit 0: clean exit), pid u32, rank i32, seq u64,
    step i64 (-2**63: none yet; a step may be negative), rss i64 (-1: unknown), time f64 (Unix seconds),
    phase 32 bytes (UTF-8, NUL-padded, truncated), seq u64 again,
    (version 3) host_pid u32 (0: not mapped), boot_id 16 bytes (zeros: unknown), seq u64 a third time

``seq`` appears at the end of each part: a reader that sees different values read the record while it
was being written (a store into the page is not atomic against a concurrent ``read``) and reads again.
Version 3 adds what device attribution needs to tell a sibling rank's GPU memory from a stranger's:
the rank's PID in the host's namespace, where this rank can see it (:mod:`rankmem.probe.pidmap`), and
the node's ``/proc/sys/kernel/random/boot_id`` (one per booted machine, shared by its containers), so
that only ranks of this node are matched against this node's PIDs. Versions 1 and 2 read as before.
"""

from __future__ import annotations

import glob
import math
import mmap
import os
import struct
import time
from dataclasses import dataclass

from rankmem.core.files import open_binary
from rankmem.core.warnings import WarnOnce
from rankmem.probe import procfs as _procfs

__all__ = ["ENV_DIR", "Heartbeat", "HeartbeatRecord", "heartbeat_dir", "heartbeat_path", "read_heartbeats"]

ENV_DIR = "RANKMEM_HEARTBEAT_DIR"
MAGIC = b"RMHB"
VERSION = 3
NO_STEP = -(2**63)
"""The step field before the first step (version 1 used -1, which hid negative steps)."""
PHASE_BYTES = 32
MAX_RANKS = 1 << 20
"""Highest rank a heartbeat may name, as many as a run log's header may claim."""
_CLEAN = 1
_RECORD = struct.Struct(f"<4sHHIiQqqd{PHASE_BYTES}sQ")
_NODE = struct.Struct("<I16sQ")  # version 3: host_pid, boot_id, seq
RECORD_SIZE = _RECORD.size + _NODE.size
BOOT_ID = "/proc/sys/kernel/random/boot_id"


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
    return os.path.join(out_dir, "heartbeat") if out_dir else None


def heartbeat_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.hb")


def _phase_bytes(phase: str | None) -> bytes:
    raw = (phase or "").encode("utf-8")[:PHASE_BYTES]
    # Never cut a multi-byte character in half: drop the partial tail.
    return raw.decode("utf-8", "ignore").encode("utf-8")


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
    host_pid: int | None = None
    """The rank's PID in the host's namespace, where it could see it (version 3); None: not mapped."""
    boot_id: bytes | None = None
    """The rank's node (its boot id, version 3); None where unknown."""


class Heartbeat:
    """This rank's heartbeat file, held open for the life of the run; never raises.

    The first record is written at construction (step None), so the launcher can map the rank's pid
    to its rank even when it dies before its first step.
    """

    def __init__(self, directory: str, rank: int, host_pid: int | None = None) -> None:
        self.path = heartbeat_path(directory, rank)
        self._rank = rank
        self._pid = os.getpid()
        self._host_pid = host_pid or 0
        self._boot = boot_id()
        self._seq = 0
        self._step = NO_STEP
        self._phase = b""
        self._phase_name: str | None = None
        self._rss = -1
        self._warn_once = WarnOnce()
        self._fd: int | None
        self._map: mmap.mmap | None = None
        try:
            os.makedirs(directory, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            self._fd = None
            self._warn_once("heartbeat", f"cannot write the heartbeat {self.path} ({exc}); the launcher "
                                         "will not know this rank's last step")
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, RECORD_SIZE)
                self._map = mmap.mmap(self._fd, RECORD_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError):
                self._map = None  # a file system that cannot map files: every beat is a pwrite
        self._write(0)

    def beat(self, step: int | None, phase: str | None, rss: int | None) -> None:
        """Record a window edge: ``step`` (None before the first), the innermost open ``phase``, and
        this process's RSS in bytes (None when unknown). One ``pack_into`` the mapped record."""
        self._seq += 1
        self._step = NO_STEP if step is None else step
        if phase != self._phase_name:  # most edges repeat the last phase: encode it once
            self._phase_name, self._phase = phase, _phase_bytes(phase)
        self._rss = -1 if rss is None else rss
        self._write(0)

    def close(self, clean: bool = True) -> None:
        """Mark the exit (``clean``: a normal one) and close the file; later beats are dropped."""
        self._write(_CLEAN if clean else 0)
        if self._map is not None:
            self._map.close()
            self._map = None
        _procfs.close_fd(self._fd)
        self._fd = None

    def _write(self, flags: int) -> None:
        if self._map is not None:
            _RECORD.pack_into(self._map, 0, MAGIC, VERSION, flags, self._pid, self._rank, self._seq, self._step,
                              self._rss, time.time(), self._phase, self._seq)
            _NODE.pack_into(self._map, _RECORD.size, self._host_pid, self._boot, self._seq)
            return
        if self._fd is None:
            return
        record = _RECORD.pack(MAGIC, VERSION, flags, self._pid, self._rank, self._seq, self._step, self._rss,
                              time.time(), self._phase, self._seq) + _NODE.pack(self._host_pid, self._boot, self._seq)
        try:
            os.pwrite(self._fd, record, 0)
        except OSError as exc:
            self._warn_once("heartbeat", f"cannot write the heartbeat {self.path} ({exc}); heartbeats stop")
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


def unpack_record(data: bytes) -> HeartbeatRecord | None:
    """The record in ``data``, or None for a short, foreign, newer-version or half-written one."""
    if len(data) < _RECORD.size:
        return None
    magic, version, flags, pid, rank, seq, step, rss, t, phase, seq2 = _RECORD.unpack_from(data)
    if magic != MAGIC or version not in (1, 2, VERSION) or seq != seq2:
        return None
    host_pid: int | None = None
    node: bytes | None = None
    if version >= 3:
        if len(data) < RECORD_SIZE:
            return None
        host, node, seq3 = _NODE.unpack_from(data, _RECORD.size)
        if seq3 != seq:
            return None
        host_pid, node = host or None, node if any(node) else None
    # Version 1 (a rank of an older rankmem on another node) wrote -1 for "no step yet".
    none = step == NO_STEP or (version == 1 and step < 0)
    return HeartbeatRecord(pid=pid, rank=rank, step=None if none else step,
                           phase=phase.rstrip(b"\0").decode("utf-8", "replace"),
                           rss_bytes=None if rss < 0 else rss, time=t, seq=seq, clean=bool(flags & _CLEAN),
                           host_pid=host_pid, boot_id=node)


def read_heartbeats(directory: str) -> dict[int, HeartbeatRecord]:
    """Every readable ``rank*.hb`` in ``directory`` by rank; short, garbage and unreadable files are
    skipped, and a missing directory is no heartbeats."""
    out: dict[int, HeartbeatRecord] = {}
    for path in glob.glob(os.path.join(glob.escape(directory), "rank*.hb")):
        record = None
        for _ in range(3):  # a torn read (seq mismatch) is retried: the writer's pwrite takes ~1 us
            try:
                with open_binary(path) as f:  # a FIFO here blocked report and watch in open()
                    record = unpack_record(f.read(RECORD_SIZE))
            except OSError:
                break
            if record is not None:
                break
        # A record is another process's bytes: its rank must be the one its name says (rank 2**31 once
        # asked watch for two billion rows) and its time a time.
        if record is not None and os.path.basename(path) == f"rank{record.rank}.hb" \
                and 0 <= record.rank < MAX_RANKS and math.isfinite(record.time):
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
