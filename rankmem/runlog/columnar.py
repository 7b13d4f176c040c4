"""The run log's columnar side file, written on the logging rank: per-rank values as an Arrow IPC stream.

Why a side file: with every rank's value of every key on each JSON line, a line grows with the world
(~10 KB at 8 ranks, ~1 MB at 1,024) and a report has to ``json.loads`` all of it. Here the step lines
keep the aggregates and the per-rank values go, one row per (collect, key), to
``rankmem.ranks.arrow``: a format pandas, polars, DuckDB and pyarrow read directly, whose numbers a
reader maps into arrays without parsing text (see :mod:`rankmem.runlog.layout` for the columns).

Why an IPC *stream* appended batch by batch: a stream has no footer, so the file is readable after a
crash up to its last whole batch, and each batch is one ``write(2)`` (cut back to the last whole batch
when the disk refuses part of it, as the JSONL writer does with lines). Collects are batched, a batch
written when :data:`FLUSH_S` has passed since the last one or :data:`MAX_BATCH` collects wait: each
batch costs a few hundred bytes of metadata and the reader a few microseconds, so one batch per
collect made a 100k-step log 3x slower to read. A crash loses at most the last second of per-rank
values; their aggregates are on the JSON lines, which a reader takes after the last batch's
:data:`~rankmem.runlog.layout.LOG_OFFSET`.

pyarrow is imported when the file is opened; without it the run log keeps the per-rank values on its
lines (the writer checks :func:`pyarrow_available` first). Online code: nothing of the reader here.
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import Any

import numpy as np

from rankmem.core.records import StepRecord
from rankmem.core.rundir import open_regular
from rankmem.core.warnings import WarnOnce
from rankmem.runlog.append import append_whole
from rankmem.runlog.checksum import CHECKSUM_KEY, HEADER_KEY, PLACEHOLDER, seal
from rankmem.runlog.layout import DETAIL_AGGREGATES, DETAIL_COLUMNS, LOG_OFFSET, RUN_KEY, WORLD_KEY

FLUSH_S = 1.0
"""Seconds between batches while collects keep coming: what a killed job loses of per-rank values."""
MAX_BATCH = 512
"""Most collects in one batch (fast collects, a synthetic log)."""
MAX_PENDING = 8192
"""Collects held while the disk refuses the batch; beyond this the oldest are dropped, counted and warned
about (their lines, if written, are no longer read: the reader takes lines after the last batch only)."""
MAX_PENDING_BYTES = 64 << 20
"""Per-rank values held while the disk refuses the batch; beyond this the oldest collects keep only their
aggregates (64 MiB is ~290 collects at 1,024 ranks x 28 keys, ~37,000 at 8 ranks)."""


def pyarrow_available() -> bool:
    """Whether pyarrow can be imported, without importing it (~45 MiB of the logging rank's RSS)."""
    import importlib.util

    return importlib.util.find_spec("pyarrow") is not None


@functools.lru_cache(maxsize=8)
def detail_schema(world: int, run_id: str | None = None, header: str = "") -> Any:
    """The side file's Arrow schema for ``world`` ranks (columns: :data:`DETAIL_COLUMNS`); its metadata
    holds the world size, the run's identity (:data:`RUN_KEY`), the CRC-32 of the run log's header line (``header``, when given) and the
    schema message's own seal (:mod:`rankmem.runlog.checksum`)."""
    import pyarrow as pa

    types = {"collect": pa.int64(), "step": pa.int64(), "time": pa.float64(), "key": pa.string(),
             "max_rank": pa.int32(), "min_rank": pa.int32(), "ranks": pa.list_(pa.float64())}
    fields = [pa.field(name, types.get(name, pa.float64()), nullable=name == "ranks") for name in DETAIL_COLUMNS]
    metadata = {WORLD_KEY: str(world).encode(), CHECKSUM_KEY: PLACEHOLDER}
    if run_id is not None:
        metadata[RUN_KEY] = run_id.encode("ascii")
    if header:
        metadata[HEADER_KEY] = header.encode()
    return pa.schema(fields, metadata=metadata)


def _schema_message(world: int, run_id: str | None, header: str) -> bytes:
    """The stream's schema message alone, unsealed: what a stream writer closed before any batch wrote,
    less its 8-byte end-of-stream marker."""
    import pyarrow as pa

    sink = _Bytes()
    pa.ipc.new_stream(sink, detail_schema(world, run_id, header)).close()
    return bytes(sink.data[:-8])


class _Bytes:
    """The stream writer's sink: gathers what one batch serialises to, so it goes out in one write."""

    closed = False

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, chunk: Any) -> int:
        self.data += chunk
        return len(chunk)

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass


class _Pending:
    """One collect waiting for its batch: its keys, aggregates (keys x 8) and per-rank matrix or None."""

    __slots__ = ("collect", "step", "time", "keys", "stats", "matrix")

    def __init__(self, collect: int, record: StepRecord, keys: tuple[str, ...], stats: np.ndarray,
                 matrix: np.ndarray | None) -> None:
        self.collect, self.step, self.time = collect, record.step, record.time
        self.keys, self.stats, self.matrix = keys, stats, matrix


class DetailWriter:
    """Appends collects to the side file at ``path``, a batch at a time (see the module's docstring).

    Never raises out of :meth:`add` or :meth:`flush`: a refused write keeps the collects pending (and
    warns once); the JSON lines go on regardless.
    """

    def __init__(self, path: str, world: int, run_id: str | None = None, header_crc: str = "") -> None:
        self.path = path
        self.world = world
        self.run_id = run_id
        self.header_crc = header_crc
        """CRC-32 of the run log's header line (:func:`rankmem.runlog.checksum.header_crc`): the reader
        pairs the two files by it and by the run id."""
        self.dropped = 0
        """Collects whose per-rank values were dropped because the disk refused them too long."""
        self._fd: int | None = None
        self._size = 0
        self._sink = _Bytes()
        self._stream: Any = None
        self._pending: list[_Pending] = []
        self._pending_bytes = 0
        self._schema_pending = b""
        self._last_flush = time.monotonic()
        self._log_offset = 0
        self._names: dict[tuple[str, ...], tuple[tuple[str, ...], list[str], np.ndarray | None]] = {}
        """A collect's keys -> the keys the side file takes, their aggregates' names, and the columns
        that keeps (None: all)."""
        self._warn_once = WarnOnce()

    def open(self) -> None:
        import pyarrow as pa

        self._fd = open_regular(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
        self._size = 0
        # pyarrow writes the schema with the first batch; if that write were refused (a full disk), the
        # schema would be gone for good and the file unreadable. So it goes to disk now, on its own, and
        # the copy the stream writer emits with its first batch is cut off in _commit.
        schema = _schema_message(self.world, self.run_id, self.header_crc)
        sealed = bytearray(schema)
        seal(sealed, 0, len(sealed))
        self._size += append_whole(self._fd, bytes(sealed), 0, self.path)  # a failure is the caller's open() failing
        self._schema_pending = schema
        self._stream = pa.ipc.new_stream(self._sink, detail_schema(self.world, self.run_id, self.header_crc))

    def add(self, collect: int, record: StepRecord, log_offset: int) -> None:
        """Queue one collect whose JSON line ends at byte ``log_offset`` of the run log; write a batch when due."""
        all_keys = tuple(record.key_names())
        layout = self._names.get(all_keys)
        if layout is None:
            layout = self._names[all_keys] = self._layout(all_keys)
        keys, names, columns = layout
        get, nan = record.metrics.get, math.nan
        stats = np.array([get(n, nan) for n in names], dtype=np.float64).reshape(len(keys), len(DETAIL_AGGREGATES))
        matrix = _matrix(record, all_keys, self.world)
        if matrix is not None and columns is not None:
            matrix = matrix[:, columns]
        self._pending.append(_Pending(collect, record, keys, stats, matrix))
        self._pending_bytes += 0 if matrix is None else matrix.nbytes
        self._log_offset = log_offset
        if len(self._pending) > MAX_PENDING or self._pending_bytes > MAX_PENDING_BYTES:
            self._shed()
        if len(self._pending) >= MAX_BATCH or time.monotonic() - self._last_flush >= FLUSH_S:
            self.flush()

    def _layout(self, keys: tuple[str, ...]) -> tuple[tuple[str, ...], list[str], np.ndarray | None]:
        # Arrow strings are UTF-8: a key that is not (a name decoded with surrogateescape) would make
        # every batch it is in fail. It stays on the run log's lines only.
        bad = [k for k in keys if not _utf8(k)]
        for key in bad:
            self._warn_once(f"key:{key!r}", f"metric key {key!r} is not valid UTF-8: its aggregates are on the run "
                                             f"log's lines only (jq/tail), not in {self.path}, so rankmem report "
                                             "and plot do not show it; name the metric in UTF-8")
        kept = tuple(k for k in keys if _utf8(k)) if bad else keys
        columns = np.array([i for i, k in enumerate(keys) if _utf8(k)], dtype=np.intp) if bad else None
        return kept, [f"{k}/{a}" for k in kept for a in DETAIL_AGGREGATES], columns

    def _shed(self) -> None:
        """The disk has refused batches for a while: bound what waits. The oldest per-rank values go first
        (their collects keep their aggregates), then, past :data:`MAX_PENDING`, the oldest collects."""
        for p in self._pending:
            if self._pending_bytes <= MAX_PENDING_BYTES:
                break
            if p.matrix is not None:
                self._pending_bytes -= p.matrix.nbytes
                p.matrix = None
                self.dropped += 1
        while len(self._pending) > MAX_PENDING:
            gone = self._pending.pop(0)
            self.dropped += gone.matrix is not None
            self._pending_bytes -= 0 if gone.matrix is None else gone.matrix.nbytes
        self._warn_once("dropped", f"{self.path} cannot be written; the per-rank values of the oldest "
                                   "collects are dropped to bound the memory they hold")

    def flush_due(self) -> None:
        """Write the pending collects if the oldest has waited :data:`FLUSH_S` (for a caller that is
        idle between collects: the writer process)."""
        if self._pending and time.monotonic() - self._last_flush >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        """Write the pending collects as one batch now (a no-op when none wait)."""
        self._last_flush = time.monotonic()
        if not self._pending or self._stream is None:
            return
        refused = _refused()
        try:
            self._write_batch()
        except OSError as exc:
            self._warn_once("write", f"writing {self.path} failed ({exc}); its per-rank values are kept and "
                                     "written again at the next batch")
            return
        except refused as exc:  # a batch pyarrow refuses must not cost the run log's lines
            # Again without the per-rank values: the collects' aggregates and steps still reach the reader.
            self._sink.data = bytearray()  # whatever the refused batch left half-encoded
            with_values = sum(p.matrix is not None for p in self._pending)
            for p in self._pending:
                p.matrix = None
            self.dropped += with_values
            try:
                self._write_batch()
            except OSError:
                return  # kept, now without their per-rank values; the next batch tries again
            except refused as again:
                self._sink.data = bytearray()
                self._warn_once("batch-lost", f"a batch could not be encoded for {self.path} ({again!r}): "
                                              f"{len(self._pending)} collect(s) are missing from it, so rankmem "
                                              "report and plot skip them; their aggregates are on the run log's "
                                              "lines (jq/tail)")
            else:
                self._warn_once("batch", f"a batch of per-rank values could not be encoded for {self.path} "
                                         f"({exc!r}); {with_values} collect(s) keep only their aggregates")
        self._pending.clear()
        self._pending_bytes = 0

    def _write_batch(self) -> None:
        batch = _batch(self._pending, self.world, self.header_crc)
        self._stream.write_batch(batch, custom_metadata={LOG_OFFSET: str(self._log_offset).encode(),
                                                         CHECKSUM_KEY: PLACEHOLDER})
        self._commit()

    def _commit(self) -> None:
        """One write of what the stream writer produced, sealed; cut back to the last whole batch if it fails."""
        data, self._sink.data = self._sink.data, bytearray()
        if self._schema_pending and data.startswith(self._schema_pending):
            del data[: len(self._schema_pending)]  # already on disk (open)
        self._schema_pending = b""
        if len(data) > 8:  # a batch's message (the end-of-stream marker alone is 8 bytes, and has no seal)
            seal(data, 0, len(data))
        assert self._fd is not None
        self._size += append_whole(self._fd, bytes(data), self._size, self.path)

    def close(self) -> None:
        self.flush()
        if self._pending:
            self._warn_once("lost", f"the per-rank values of {len(self._pending)} collect(s) could not be "
                                    f"written to {self.path} before closing (their aggregates are in the run log)")
        self._pending.clear()
        self._pending_bytes = 0
        if self._stream is not None:
            try:
                self._stream.close()  # the end-of-stream marker
                self._commit()
            except OSError:
                pass
            self._stream = None
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _utf8(key: str) -> bool:
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _matrix(record: StepRecord, keys: tuple[str, ...], world: int) -> np.ndarray | None:
    """The record's ranks x keys values (NaN where absent), or None when it carries no detail."""
    if record.matrix is not None:
        m = np.asarray(record.matrix, dtype=np.float64)
        return m if m.shape == (world, len(keys)) else None
    if not record.ranks:
        return None
    out = np.full((world, len(keys)), np.nan)
    for j, key in enumerate(keys):
        vec = record.ranks.get(key) or []
        out[: min(len(vec), world), j] = [math.nan if v is None else v for v in vec[:world]]
    return out


def _refused() -> tuple[type[Exception], ...]:
    """What encoding a batch raises when pyarrow refuses its values: an ``ArrowException`` (its
    ``ArrowInvalid`` and ``ArrowTypeError`` are also ValueError and TypeError), or the ``ValueError`` a
    key with a lone surrogate gives (``UnicodeEncodeError``). Anything else is a bug, for the sink's
    boundary to report."""
    import pyarrow as pa

    return (pa.ArrowException, ValueError)


def _batch(pending: list[_Pending], world: int, header: str) -> Any:
    """The pending collects as one record batch, one row per (collect, key), ordered key by key (then by
    collect): a reader then copies each key's per-rank values of the batch as one block."""
    import pyarrow as pa

    sizes = np.array([len(p.keys) for p in pending])
    keys = [k for p in pending for k in p.keys]
    names = sorted(set(keys))
    rank_of = {k: i for i, k in enumerate(names)}
    collect = np.repeat(np.arange(len(pending)), sizes)  # rows in collect order first
    order = np.lexsort((collect, np.array([rank_of[k] for k in keys], dtype=np.intp)))
    valid = np.repeat([p.matrix is not None for p in pending], sizes)
    # A variable-size list, not a fixed-size one: a collect without per-rank values (most of them past
    # the crossover) then costs 4 bytes of offset per key instead of world x 8 bytes of padding.
    matrices = [p.matrix.T for p in pending if p.matrix is not None]
    dense = np.concatenate(matrices) if matrices else np.empty((0, world))  # the valid rows, collect order
    dense_row = np.cumsum(valid) - 1
    valid = valid[order]
    values = dense[dense_row[order][valid]]
    offsets = np.zeros(len(keys) + 1, dtype=np.int32)
    np.cumsum(np.where(valid, world, 0), out=offsets[1:])
    stats = (np.vstack([p.stats for p in pending]) if keys else np.empty((0, len(DETAIL_AGGREGATES))))[order]
    columns: list[Any] = [
        pa.array(np.array([p.collect for p in pending], dtype=np.int64)[collect[order]]),
        pa.array(np.array([p.step for p in pending], dtype=np.int64)[collect[order]]),
        pa.array(np.array([p.time for p in pending], dtype=np.float64)[collect[order]]),
        pa.array([keys[i] for i in order.tolist()], type=pa.string()),
    ]
    for j, name in enumerate(DETAIL_AGGREGATES):
        col = stats[:, j]
        if name.endswith("_rank"):
            col = np.where(np.isfinite(col), col, -1).astype(np.int32)
        columns.append(pa.array(col))
    columns.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.ravel()), mask=pa.array(~valid)))
    return pa.record_batch(columns, schema=detail_schema(world, header=header))
