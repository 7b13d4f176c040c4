"""The logging rank's end of the side-file writer process: pyarrow never enters the rank.

The columnar side file (:mod:`rankmem.runlog.columnar`) needs pyarrow, whose import alone grows a
process by ~45 MiB: on the logging rank that made it the "worst" rank of every job whose ranks are
closer than that (issue 22). :class:`DetailPipe` has :class:`~rankmem.runlog.columnar.DetailWriter`'s
interface and hands each collect, as a few raw float64 blocks, to a writer process
(:mod:`rankmem.runlog.detail_child`) started when the run log opens, which runs the same writer there.

- **Never blocks training**: the pipe is non-blocking; what it does not take waits in a queue bounded
  by :data:`MAX_QUEUED_BYTES`, beyond which the oldest collects' per-rank values are dropped (counted,
  warned about once); their aggregates still go, as the in-process writer's shedding keeps them.
- **Dies with the rank, after writing what it got**: the writer ends at a close frame or at the end of
  its input, which comes when the rank exits or is killed. A dataloader worker forked by the rank
  holds the pipe open until it exits too.
- :meth:`flush` waits (up to :data:`FLUSH_TIMEOUT_S`) until the writer has put every collect sent so
  far on disk: a near-OOM event or ``Monitor.flush()`` then finds them there.

Frames: a little-endian u32 length, a kind byte, the body. ``K``: a new key set (JSON list; numbered in
order of arrival); ``A``: a collect (:data:`ADD_HEAD`, then keys x aggregates float64, then world x keys
float64 if it carries per-rank values); ``F``: flush, its u64 sequence number echoed when done; ``C``: close.
"""

from __future__ import annotations

import collections
import json
import math
import os
import select
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np

from rankmem.core import helpers
from rankmem.core.records import StepRecord
from rankmem.core.warnings import WarnOnce
from rankmem.runlog.columnar import _matrix
from rankmem.runlog.layout import DETAIL_AGGREGATES

KEYS, ADD, FLUSH, CLOSE = b"K", b"A", b"F", b"C"
ADD_HEAD = struct.Struct("<iqqdqB")
"""An ``A`` frame's head: key set number, collect, step, time, run-log offset, carries per-rank values."""
_LEN = struct.Struct("<I")
MAX_QUEUED_BYTES = 64 << 20
"""Frames waiting for the writer process, at most; the oldest collects go first."""
FLUSH_TIMEOUT_S = 10.0
"""How long :meth:`DetailPipe.flush` waits for the writer (its start takes ~0.5 s: pyarrow's import)."""
EXIT_TIMEOUT_S = 10.0
"""How long :meth:`DetailPipe.close` waits for the writer to write what waits and exit, in all."""


def frame(kind: bytes, *parts: bytes | memoryview) -> bytes:
    body = b"".join(parts)
    return _LEN.pack(len(body) + 1) + kind + body


def read_frames(buffer: bytearray) -> Iterator[tuple[bytes, bytes]]:
    """The whole frames at the start of ``buffer`` (consumed from it), as (kind, body)."""
    at = 0
    while len(buffer) - at >= _LEN.size:
        (size,) = _LEN.unpack_from(buffer, at)
        if len(buffer) - at - _LEN.size < size:
            break
        start = at + _LEN.size
        yield bytes(buffer[start : start + 1]), bytes(buffer[start + 1 : start + size])
        at = start + size
    del buffer[:at]


class DetailPipe:
    """:class:`~rankmem.runlog.columnar.DetailWriter`'s interface, writing through the writer process."""

    def __init__(self, path: str, world: int, run_id: str | None = None, header_crc: str = "") -> None:
        self.path = path
        self.world = world
        self.run_id = run_id
        self.header_crc = header_crc
        self.dropped = 0
        """Collects whose per-rank values never reached the writer (queue full, or the writer gone)."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._queue: collections.deque[tuple[bytes, bool, bytes | None]] = collections.deque()  # (frame, is a collect, lean)
        self._queued = 0
        self._head_sent = 0  # bytes of the queue's first frame already in the pipe
        self._keysets: dict[tuple[str, ...], tuple[int, list[str]]] = {}
        self._flushes = 0
        self._acked = 0
        self._warn_once = WarnOnce()
        self._killed: subprocess.Popen[bytes] | None = None  # a writer killed by _gone, reaped at close

    def open(self) -> None:
        # -m, not a fork: a fork would copy the rank (torch, CUDA state) to run a few hundred lines.
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "rankmem.runlog.detail_child", self.path, str(self.world), self.run_id or "",
             self.header_crc],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        helpers.register(self._proc.pid)  # rankmem's own: not one of the rank's workers (children figures)
        assert self._proc.stdin is not None
        os.set_blocking(self._proc.stdin.fileno(), False)

    def add(self, collect: int, record: StepRecord, log_offset: int) -> None:
        """Queue one collect for the writer and send what the pipe takes; never waits."""
        if self._proc is None:
            return
        keys = tuple(record.key_names())
        known = self._keysets.get(keys)
        if known is None:
            known = self._keysets[keys] = (len(self._keysets), [f"{k}/{a}" for k in keys for a in DETAIL_AGGREGATES])
            self._put(frame(KEYS, json.dumps(list(keys)).encode()), collect=False)
        number, names = known
        get, nan = record.metrics.get, math.nan
        stats = np.array([get(n, nan) for n in names], dtype=np.float64)
        matrix = _matrix(record, keys, self.world)
        head = ADD_HEAD.pack(number, collect, record.step, record.time, log_offset, matrix is not None)
        if matrix is None:
            self._put(frame(ADD, head, stats.tobytes()), collect=True)
        else:
            lean = frame(ADD, ADD_HEAD.pack(number, collect, record.step, record.time, log_offset, False),
                         stats.tobytes())
            self._put(frame(ADD, head, stats.tobytes(), np.ascontiguousarray(matrix).tobytes()), True, lean)
        self._send()

    def _put(self, data: bytes, collect: bool, lean: bytes | None = None) -> None:
        """Queue a frame; ``lean``: the same collect without its per-rank values, what shedding keeps."""
        self._queue.append((data, collect, lean))
        self._queued += len(data)
        if self._queued > MAX_QUEUED_BYTES:
            self._shed()

    def _shed(self) -> None:
        """The writer is behind: the oldest collects not yet started into the pipe lose their per-rank
        values first (their aggregates and steps still reach the side file, so the reader keeps them),
        then, past the bound still, whole collects go (key sets and flushes stay)."""
        queue = list(self._queue)
        for i, (data, collect, lean) in enumerate(queue):
            if self._queued <= MAX_QUEUED_BYTES // 2:
                break
            if lean is not None and not (i == 0 and self._head_sent):
                queue[i] = (lean, collect, None)
                self._queued -= len(data) - len(lean)
                self.dropped += 1
        kept: collections.deque[tuple[bytes, bool, bytes | None]] = collections.deque()
        for i, (data, collect, lean) in enumerate(queue):
            if self._queued > MAX_QUEUED_BYTES and collect and not (i == 0 and self._head_sent):
                self._queued -= len(data)
                self.dropped += lean is not None
                continue
            kept.append((data, collect, lean))
        self._queue = kept
        self._warn_once("behind", f"the writer of {self.path} is behind; the oldest collects' per-rank values "
                                  "are dropped (their aggregates are kept)")

    def _send(self) -> bool:
        """Write queued frames until the pipe is full; True when the queue is empty."""
        proc = self._proc
        if proc is None or proc.stdin is None:
            return True
        fd = proc.stdin.fileno()
        while self._queue:
            data = memoryview(self._queue[0][0])[self._head_sent :]
            try:
                n = os.write(fd, data)
            except BlockingIOError:
                return False
            except OSError as exc:
                self._gone(exc)
                return True
            self._head_sent += n
            if self._head_sent == len(self._queue[0][0]):
                self._queued -= len(self._queue.popleft()[0])
                self._head_sent = 0
        return True

    def _gone(self, exc: OSError | None) -> None:
        lost = sum(collect for _, collect, _ in self._queue)
        self.dropped += lost
        self._queue.clear()
        self._queued = self._head_sent = 0
        proc = self._proc
        code = proc.poll() if proc is not None else None
        self._close_pipes()
        if proc is not None:
            # Of no more use, and it must not outlive the rank; no wait here (add() never waits): the
            # kill is reaped at close, or by subprocess's own clean-up of a dropped Popen.
            if code is None:
                proc.kill()
                self._killed = proc
            helpers.unregister(proc.pid)
        if code is not None:
            why = f"exited with code {code}"
        else:
            why = f"stopped reading ({exc}) and was killed" if exc is not None else "closed its end of the pipe"
        self._warn_once("gone", f"the writer process of {self.path} {why}: the per-rank values of the "
                                f"following collects are on the run log's lines only as aggregates")

    def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> bool:
        """Send what waits and wait until the writer has written it; False if ``timeout`` passed first."""
        if self._proc is None:
            return True
        deadline = time.monotonic() + timeout
        self._flushes += 1
        self._put(frame(FLUSH, struct.pack("<Q", self._flushes)), collect=False)
        while not self._send():
            if not self._wait(self._proc.stdin, deadline, write=True):
                return False
        while self._proc is not None and self._acked < self._flushes:
            if not self._wait(self._proc.stdout, deadline, write=False):
                return False
            assert self._proc.stdout is not None
            data = os.read(self._proc.stdout.fileno(), 8 * 64)
            if not data:
                self._gone(None)
                return False
            self._acked = max(self._acked, *struct.unpack(f"<{len(data) // 8}Q", data[: len(data) // 8 * 8]))
        return True

    @staticmethod
    def _wait(pipe: object, deadline: float, write: bool) -> bool:
        left = deadline - time.monotonic()
        if pipe is None or left <= 0:
            return False
        fd = pipe.fileno()  # type: ignore[attr-defined]
        ready = select.select([], [fd], [], left)[1] if write else select.select([fd], [], [], left)[0]
        return bool(ready)

    def close(self) -> None:
        """Send what waits, ask the writer to finish, wait for it (then kill it: it must not outlive us)."""
        if self._killed is not None:
            _end(self._killed)
            self._killed = None
        if self._proc is None:
            return
        deadline = time.monotonic() + EXIT_TIMEOUT_S  # one bound for the last flush and the exit together
        self.flush(EXIT_TIMEOUT_S)
        self._put(frame(CLOSE), collect=False)
        while self._proc is not None and not self._send():
            if not self._wait(self._proc.stdin, deadline, write=True):
                break
        proc = self._proc
        self._close_pipes()
        if proc is None:
            return
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            _end(proc)
            self._warn_once("killed", f"the writer process of {self.path} did not finish in "
                                      f"{EXIT_TIMEOUT_S:.0f} s and was killed; its last batch may be missing")
        finally:
            helpers.unregister(proc.pid)
        if self._queue:
            self.dropped += sum(collect for _, collect, _ in self._queue)
            self._queue.clear()

    def _close_pipes(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass  # a writer that is gone: nothing of ours was buffered in the file object


def _end(proc: subprocess.Popen[bytes]) -> None:
    """Kill the writer (if it still runs) and reap it; a writer that will not die is left to init."""
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass  # in uninterruptible sleep: the kernel ends it; waiting longer would stall training
