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
    phase 32 bytes (UTF-8, NUL-padded, truncated), seq u64 again

``seq`` appears twice: a reader that sees two different values read the record while it was being
written (a store into the page is not atomic against a concurrent ``read``) and reads again.
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
VERSION = 2
NO_STEP = -(2**63)
"""The step field before the first step (version 1 used -1, which hid negative steps)."""
PHASE_BYTES = 32
MAX_RANKS = 1 << 20
"""Highest rank a heartbeat may name, as many as a run log's header may claim."""
_CLEAN = 1
_RECORD = struct.Struct(f"<4sHHIiQqqd{PHASE_BYTES}sQ")
RECORD_SIZE = _RECORD.size


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


class Heartbeat:
    """This rank's heartbeat file, held open for the life of the run; never raises.

    The first record is written at construction (step None), so the launcher can map the rank's pid
    to its rank even when it dies before its first step.
    """

    def __init__(self, directory: str, rank: int) -> None:
        self.path = heartbeat_path(directory, rank)
        self._rank = rank
        self._pid = os.getpid()
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
            return
        if self._fd is None:
            return
        record = _RECORD.pack(MAGIC, VERSION, flags, self._pid, self._rank, self._seq, self._step, self._rss,
                              time.time(), self._phase, self._seq)
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
    if len(data) < RECORD_SIZE:
        return None
    magic, version, flags, pid, rank, seq, step, rss, t, phase, seq2 = _RECORD.unpack_from(data)
    if magic != MAGIC or version not in (1, VERSION) or seq != seq2:
        return None
    # Version 1 (a rank of an older rankmem on another node) wrote -1 for "no step yet".
    none = step == NO_STEP or (version == 1 and step < 0)
    return HeartbeatRecord(pid=pid, rank=rank, step=None if none else step,
                           phase=phase.rstrip(b"\0").decode("utf-8", "replace"),
                           rss_bytes=None if rss < 0 else rss, time=t, seq=seq, clean=bool(flags & _CLEAN))


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
