"""Reading the run log's columnar side file (:mod:`rankmem.runlog.columnar`) into arrays. Offline code.

The file is memory-mapped and read batch by batch until its end, or until a batch that is not whole
(a crash mid-write: flagged, never misread). The per-rank values are never parsed: each batch's
``ranks`` column is a view of the mapped file, scattered into one ``keys x collects x ranks`` array
per run, so the reader's heap holds the result and little else (see :func:`read_detail`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rankmem.core.files import NotRegularFile, open_regular
from rankmem.errors import MissingExtraError, RankmemError
from rankmem.runlog.checksum import HEADER_KEY, frame, header_crc, sealed
from rankmem.runlog.layout import DETAIL_AGGREGATES, DETAIL_COLUMNS, LOG_OFFSET, RUN_KEY, WORLD_KEY

_SCATTER_ROWS = 1 << 16
"""Rows of ranks gathered from the mapped batches before each scatter: bounds the copy (64k rows x 8
bytes x world) while keeping the numpy calls few when batches are small (one collect each)."""


@dataclass
class Detail:
    """The side file's collects: one entry per collect, in file order, and the per-rank cube."""

    steps: np.ndarray
    times: np.ndarray
    has_detail: np.ndarray
    """Per collect: whether it carried per-rank values."""
    keys: list[str]
    cube: np.ndarray
    """keys x (collects with detail) x ranks, float64, NaN where absent."""
    log_offset: int
    """The run log's size after the line of the last collect read here: its lines after it are not here."""
    truncated: bool = False
    """True when the file ends inside a batch (the last whole batch was read)."""
    error: str | None = None
    """Why reading stopped early other than a cut-off end (a damaged batch), for the report."""
    _rows: dict[str, np.ndarray] = field(default_factory=dict)
    """Per-row ``collect`` position and ``key`` index, for :meth:`aggregates`."""
    _table: Any = None
    """The mapped batches, whose aggregate columns :meth:`aggregates` reads when asked (a run whose every
    collect has per-rank values never needs them: they are a function of those)."""

    def series(self) -> dict[str, np.ndarray]:
        return {k: self.cube[i] for i, k in enumerate(self.keys)}

    def aggregates(self) -> dict[str, np.ndarray]:
        """``K/max``, ``K/min``, ... of every collect (NaN where a collect lacks ``K``; -1 ranks where
        it has ``K`` but no rank a value)."""
        n, keys = self.steps.size, self.keys
        if self._table is None:
            return {}
        where, key_of = self._rows["collect"], self._rows["key"]
        out: dict[str, np.ndarray] = {}
        for name in DETAIL_AGGREGATES:
            grid = np.full((len(keys), n), np.nan)
            grid[key_of, where] = self._table.column(name).to_numpy()
            if not name.endswith("_rank") and not np.isfinite(grid).any():
                continue  # the quantiles of an all-gather run: none were written
            for i, key in enumerate(keys):
                out[f"{key}/{name}"] = grid[i]
        return out


def read_detail(path: str, world: int, run_id: str | None = None, header_line: bytes | None = None) -> Detail:
    """Read the side file at ``path`` written for ``world`` ranks, whose run log's header line (newline
    included) is ``header_line`` when given.

    Nothing of the file reaches pyarrow before it is checked: each message's framing is read with its
    lengths bounded by the file, and its seal (:mod:`rankmem.runlog.checksum`) checked, so a damaged
    message (a flipped bit) ends the read there, named in :attr:`Detail.error`, never misread and never
    a crash inside pyarrow. A side file written before seals is validated in full instead, and each
    batch's values checked against its own aggregates. The file is read, not memory-mapped: a mapping
    of a file that another process truncates faults (SIGBUS). RankmemError when the file is not a side
    file of this run (no Arrow schema, another world size, another run id than ``run_id``, another header) or pyarrow is missing.
    """
    try:
        import pyarrow as pa
    except ImportError:
        raise MissingExtraError(f"reading {path} (the run's per-rank values, Arrow format)", "", "pyarrow",
                                "pip install pyarrow (a dependency of rankmem)") from None
    try:
        data = _mapped(path, pa)
    except OSError as exc:
        raise RankmemError(f"{path} cannot be read ({exc.strerror or exc})") from None
    checked = _check_messages(memoryview(data), path)
    batches: list[Any] = []
    offsets: list[int] = []
    error = checked.error
    try:
        reader = pa.ipc.open_stream(data.slice(0, checked.end))
    except (pa.ArrowInvalid, OSError) as exc:
        raise RankmemError(f"{path} is not a rankmem per-rank file ({exc}); move it aside to read the run "
                           "log's aggregates alone") from None
    _check_schema(reader.schema, world, path, header_line)
    _check_run(reader.schema, run_id, path)
    while True:
        try:
            batch, meta = reader.read_next_batch_with_custom_metadata()
        except StopIteration:
            break
        except (pa.ArrowInvalid, OSError) as exc:  # a message that passed its checks but not pyarrow's
            error = f"batch {len(batches) + 1}: {exc}"
            break
        problem = None if checked.sealed else _legacy_problem(batch)
        if problem is None and not _whole(batch, world):
            problem = f"holds per-rank lists that are not {world} long"
        if problem is not None:
            error = f"batch {len(batches) + 1} {problem}"
            break
        batches.append(batch)
        offsets.append(_offset(meta))
    return _assemble(batches, world, offsets[-1] if offsets else 0, checked.truncated and error is None, error)


def _mapped(path: str, pa: Any) -> Any:
    """The regular file at ``path`` (never a FIFO: :func:`open_regular`) as one mapped pyarrow buffer of
    the size it has now. Not closed here: the batches are views of the mapping, which lives as long as
    they do."""
    fd = open_regular(path)
    try:
        if os.fstat(fd).st_size == 0:
            return pa.py_buffer(b"")
        # The descriptor already checked, not the path again: a FIFO renamed over it meanwhile would block.
        return pa.memory_map(f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else path).read_buffer()
    finally:
        os.close(fd)


class _Checked:
    """How far a side file's messages hold: the byte where the first damaged or cut-off one starts."""

    def __init__(self, end: int, sealed: bool, truncated: bool, error: str | None) -> None:
        self.end, self.sealed, self.truncated, self.error = end, sealed, truncated, error


def _check_messages(data: memoryview, path: str) -> _Checked:
    """Walk the file's messages: framing bounded, seal checked. The schema's seal says whether the
    file is sealed; a sealed file's message without one is damaged (its seal's text was hit)."""
    def read(at: int, n: int) -> memoryview:
        return data[at : at + n]

    at, index, file_sealed = 0, 0, False
    while True:
        found = frame(read, at, len(data))
        if found is None:
            return _Checked(at, file_sealed, False, None)
        what = "the schema" if index == 0 else f"batch {index}"
        if isinstance(found, str):
            if index == 0:
                raise RankmemError(f"{path} is not a rankmem per-rank file ({found}); move it aside to read the "
                                   "run log's aggregates alone")
            truncated = found == "truncated"
            return _Checked(at, file_sealed, truncated, None if truncated else f"{what} is damaged ({found})")
        ok = sealed(data[found.start : found.end], found.metadata_end - found.start)
        if index == 0:
            file_sealed = ok is not None
        if ok is False or (ok is None and file_sealed):
            if index == 0:
                raise RankmemError(f"{path}: its schema is damaged (checksum mismatch); move it aside to read the "
                                   "run log's aggregates alone")
            return _Checked(at, file_sealed, False, f"{what} (at byte {at}) is damaged: its checksum does not "
                                                    "match")
        at, index = found.end, index + 1


def _legacy_problem(batch: Any) -> str | None:
    """For a batch without a seal: pyarrow's full validation (offsets and lengths inside their buffers)
    before any value is touched, then its per-rank values against its own max and min."""
    import pyarrow as pa

    try:
        batch.validate(full=True)
    except (pa.ArrowInvalid, pa.ArrowException) as exc:
        return f"is damaged ({exc})"
    names = batch.schema.names
    if "max" not in names or "min" not in names:
        return None
    ranks = batch.column(names.index("ranks"))
    valid = ranks.is_valid().to_numpy(zero_copy_only=False)
    if not valid.any():
        return None
    lengths = ranks.value_lengths().to_numpy(zero_copy_only=False)[valid]
    if lengths.size and not (lengths == lengths[0]).all():
        return None  # _whole names it
    values = ranks.flatten().to_numpy(zero_copy_only=False).reshape(int(valid.sum()), -1)
    for name, fold in (("max", np.fmax.reduce), ("min", np.fmin.reduce)):
        stored = batch.column(names.index(name)).to_numpy(zero_copy_only=False)[valid]
        with np.errstate(invalid="ignore"):
            got = fold(values, axis=1) if values.shape[1] else np.full(stored.shape, np.nan)
        if not np.array_equal(got, stored, equal_nan=True):
            return f"holds per-rank values that disagree with its own {name} (damaged)"
    return None


def empty_detail(world: int, log_offset: int = 0, truncated: bool = False, error: str | None = None) -> Detail:
    """No collects: a side file with no whole batch yet, or none at all."""
    empty = np.empty(0)
    return Detail(empty.astype(np.int64), empty, empty.astype(bool), [], np.empty((0, 0, world)), log_offset,
                  truncated, error)


def _check_schema(schema: Any, world: int, path: str, header_line: bytes | None = None) -> None:
    missing = [c for c in ("collect", "step", "time", "key", "ranks") if c not in schema.names]
    metadata = schema.metadata or {}
    got = metadata.get(WORLD_KEY, b"?").decode(errors="replace")
    if missing or got != str(world):
        raise RankmemError(f"{path} does not match its run log (columns missing: {missing or 'none'}; written "
                           f"for a world of {_short_text(got)}, the log's is {world}): is it from another run?")
    want = metadata.get(HEADER_KEY)
    if want is not None and header_line is not None and want.decode(errors="replace") != header_crc(header_line):
        raise RankmemError(f"{path} does not match its run log's header line (the header is damaged, or the side "
                           "file is from another run): its per-rank values are not read")


def _short_text(text: str) -> str:
    return text if len(text) <= 20 else text[:20] + "..."


def _check_run(schema: Any, run_id: str | None, path: str) -> None:
    """A log whose header has a run id takes only the side file written with it: a side file left by
    another run (rotated apart, copied in) may match its world size and be read as this run's."""
    if run_id is None:
        return
    got = (schema.metadata or {}).get(RUN_KEY)
    written = got.decode("ascii", "replace") if got is not None else "none"
    if written != run_id:
        raise RankmemError(f"{path} is from another run (run id {written[:16]}, the log's is {run_id}): its "
                           "per-rank values are not read")


def _whole(batch: Any, world: int) -> bool:
    """Every per-rank list of the batch holds exactly ``world`` values (what the writer writes)."""
    ranks = batch.column(batch.schema.get_field_index("ranks"))
    lengths = ranks.value_lengths().to_numpy(zero_copy_only=False)
    valid = ranks.is_valid().to_numpy(zero_copy_only=False)
    return bool((lengths[valid] == world).all())


def _offset(meta: Any) -> int:
    try:
        return int(meta[LOG_OFFSET]) if meta is not None and LOG_OFFSET in meta else 0
    except ValueError:
        return 0


def _assemble(batches: list[Any], world: int, log_offset: int, truncated: bool, error: str | None) -> Detail:
    import pyarrow as pa
    import pyarrow.compute as pc

    if not batches:
        return empty_detail(world, log_offset, truncated, error)
    table = pa.Table.from_batches(batches)
    regular = _regular(batches, world)
    if regular is not None:  # the common case: every collect has per-rank values of the same keys
        keys, sizes, cube = regular
        steps = np.concatenate([b.column(1).to_numpy()[:m] for b, m in zip(batches, sizes, strict=True)])
        times = np.concatenate([b.column(2).to_numpy()[:m] for b, m in zip(batches, sizes, strict=True)])
        return Detail(steps, times, np.ones(steps.size, dtype=bool), keys, cube, log_offset, truncated, error,
                      _regular_rows(sizes, len(keys)), table)
    collect = table.column("collect").to_numpy()
    # Collect numbers rise through the file: sorted, they are the collects in file order.
    _, first, position = np.unique(collect, return_index=True, return_inverse=True)
    key_column = table.column("key")
    keys = sorted(pc.unique(key_column).to_pylist())
    key_of = pc.index_in(key_column, value_set=pa.array(keys, pa.string())).to_numpy()
    valid = table.column("ranks").is_valid().to_numpy(zero_copy_only=False)
    has_detail = np.zeros(first.size, dtype=bool)
    has_detail[position[valid]] = True
    detail_at = np.cumsum(has_detail) - 1  # a collect's row in the cube
    cube_row = detail_at[position]
    # Not np.full: every (key, collect) a row fills is written once, so only the rest needs its NaN.
    cube = np.empty((len(keys), int(has_detail.sum()), world))
    covered = np.zeros(cube.shape[:2], dtype=bool)
    covered[key_of[valid], cube_row[valid]] = True
    cube[~covered] = np.nan
    _scatter(table.column("ranks"), valid, key_of, cube_row, cube, world)
    return Detail(table.column("step").to_numpy()[first], table.column("time").to_numpy()[first], has_detail,
                  keys, cube, log_offset, truncated, error, {"collect": position, "key": key_of}, table)


def _regular(batches: list[Any], world: int) -> tuple[list[str], list[int], np.ndarray] | None:
    """(keys, collects per batch, keys x collects x ranks) when every collect holds per-rank values of the
    same keys: each batch is then ``keys`` blocks of its collects, in the writer's order, and each block
    is copied whole into its key's rows. None otherwise (the general path places row by row)."""
    import pyarrow as pa

    keys = sorted(set(batches[0].column(3).to_pylist()))
    k, sizes, last = len(keys), [], -1
    expected: dict[int, Any] = {}
    for batch in batches:
        m, rest = divmod(batch.num_rows, k)
        ranks = batch.column(len(batch.schema) - 1)
        if rest or m == 0 or ranks.null_count:
            return None
        if m not in expected:
            expected[m] = pa.array([key for key in keys for _ in range(m)], pa.string())
        collect = batch.column(0).to_numpy().reshape(k, m)
        if not batch.column(3).equals(expected[m]) or not (collect == collect[0]).all() \
                or collect[0, 0] <= last or (m > 1 and not (collect[0, 1:] > collect[0, :-1]).all()):
            return None
        last = int(collect[0, -1])
        sizes.append(m)
    cube = np.empty((k, sum(sizes), world))
    at = 0
    for batch, m in zip(batches, sizes, strict=True):
        ranks = batch.column(len(batch.schema) - 1)
        cube[:, at : at + m] = ranks.flatten().to_numpy(zero_copy_only=False).reshape(k, m, world)
        at += m
    return keys, sizes, cube


def _regular_rows(sizes: list[int], k: int) -> dict[str, np.ndarray]:
    """Each row's collect position and key index in the regular layout (key blocks within a batch)."""
    collect, key, at = [], [], 0
    for m in sizes:
        collect.append(np.tile(np.arange(at, at + m), k))
        key.append(np.repeat(np.arange(k), m))
        at += m
    return {"collect": np.concatenate(collect), "key": np.concatenate(key)}


def _scatter(ranks: Any, valid: np.ndarray, key_of: np.ndarray, cube_row: np.ndarray, cube: np.ndarray,
             world: int) -> None:
    """Each valid row's per-rank values into ``cube[key, row]``, from views of the mapped file, a few
    batches at a time (a null list holds no values: past the crossover most rows have none)."""
    at, count = 0, 0
    values: list[np.ndarray] = []
    rows: list[np.ndarray] = []
    # One index into (key, collect) pairs: numpy copies a row per index, ~4x faster than two index arrays.
    target, slot = cube.reshape(-1, world), key_of * cube.shape[1] + cube_row

    def scatter() -> None:
        nonlocal values, rows, count
        if values:
            target[slot[np.concatenate(rows)]] = np.concatenate(values) if len(values) > 1 else values[0]
        values, rows, count = [], [], 0

    for chunk in ranks.chunks:
        n = len(chunk)
        got = chunk.flatten().to_numpy(zero_copy_only=False).reshape(-1, world)
        if got.shape[0]:
            values.append(got)
            rows.append(at + np.flatnonzero(valid[at : at + n]))
            count += got.shape[0]
        at += n
        if count >= _SCATTER_ROWS:
            scatter()
    scatter()


class DetailFollower:
    """Follows a side file that is still being written: :meth:`poll` returns the newest collect's step and
    per-rank values, reading only the bytes added since the last call (whole batches; a batch still
    being written is left for the next call). ``rankmem watch`` draws its per-rank rows from it."""

    def __init__(self, path: str, header_line: bytes | None = None) -> None:
        self.path = path
        self.header_line = header_line
        """The run log's header line, when known: a side file sealed for another header is not followed."""
        self.latest: tuple[int, dict[str, list[float | None]]] | None = None
        self._offset = 0
        self._schema: Any = None
        self._identity: tuple[int, int] | None = None
        self._sealed = False
        self.damaged: str | None = None
        """Why following stopped (a damaged message), or None."""
        self.recent: list[tuple[int, float]] = []
        """(step, time) of the newest collects in the file (at most 2, oldest first): what the run log's
        last lines must say (:meth:`check_lines`)."""
        self.closed = False
        """The file ends with the end-of-stream marker: the writer closed it, so it holds every collect."""

    def poll(self) -> tuple[int, dict[str, list[float | None]]] | None:
        try:
            import pyarrow as pa

            fd = open_regular(self.path)
        except NotRegularFile as exc:
            self.damaged, self._identity = str(exc), None
            return self.latest
        except (ImportError, OSError):
            return self.latest
        try:
            st = os.fstat(fd)
            identity = (st.st_dev, st.st_ino)
            if identity != self._identity or st.st_size < self._offset:  # a new run moved the old file aside
                self._identity, self._offset, self._schema, self.latest = identity, 0, None, None
                self._sealed, self.damaged, self.recent, self.closed = False, None, [], False
            if st.st_size == self._offset or self.damaged:
                return self.latest
            batch = self._read_new(fd, st.st_size, pa)
        finally:
            os.close(fd)
        found = _last_collect(batch) if batch is not None else None
        if found is not None:
            self.latest = found
        return self.latest

    def _read_new(self, fd: int, size: int, pa: Any) -> Any:
        """The last batch with per-rank values among the whole messages added since the last poll, each
        read on its own (a first poll of a long run's file holds one batch, not the file) and checked
        before pyarrow decodes it; a damaged one stops the follower there (:attr:`damaged`)."""
        # Mapped (to the size fstat gave, and no length followed past it), not read: a first poll of a
        # long run's file (gigabytes at scale) then holds no batch's values on the heap.
        mapped = pa.memory_map(f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else self.path)
        data = memoryview(mapped.read_buffer(size))

        def read(at: int, n: int) -> memoryview:
            return data[at : at + n]

        batch = None
        while True:
            found = frame(read, self._offset, size)
            if found is None or found == "truncated":
                self.closed = bytes(read(self._offset, 8)) == _END_OF_STREAM
                return batch  # the end, the end-of-stream marker, or a batch still being written
            if isinstance(found, str):
                self.damaged = found
                return batch
            message = data[found.start : found.end]
            ok = sealed(message, found.metadata_end - found.start)
            if self._schema is None:
                self._sealed = ok is not None
            if ok is False or (ok is None and self._sealed):
                self.damaged = f"the message at byte {found.start} is damaged: its checksum does not match"
                return batch
            try:
                decoded = pa.ipc.read_message(pa.py_buffer(message))  # a view, not a copy
                if self._schema is None:
                    self._schema = pa.ipc.read_schema(decoded)
                    if not set(DETAIL_COLUMNS) <= set(self._schema.names):
                        raise KeyError("not a rankmem per-rank file: columns missing")
                    want = (self._schema.metadata or {}).get(HEADER_KEY)
                    if want is not None and self.header_line is not None \
                            and want.decode(errors="replace") != header_crc(self.header_line):
                        self.damaged = "it does not match the run log's header (damaged, or another run's file)"
                        return batch
                else:
                    got = pa.ipc.read_record_batch(decoded, self._schema)
                    if not self._sealed:
                        got.validate(full=True)
                    self.recent = (self.recent + _collects(got))[-2:]
                    if got.column(got.schema.get_field_index("ranks")).null_count < got.num_rows:
                        batch = got  # past the crossover most collects carry none: keep the last that does
            except (pa.ArrowException, OSError, KeyError, TypeError) as exc:
                self.damaged = f"the message at byte {found.start} cannot be decoded ({exc})"
                return batch
            self._offset = found.end


    def check_lines(self, lines: list[tuple[Any, Any]]) -> str | None:
        """Why the run log's newest lines, as ``(step, time)`` oldest first, disagree with the side file
        (a damaged line: JSON has no checksum, the side file has), or None. Only a closed file must hold
        the last lines' collects; a live one may be a second behind, and is checked where it has them."""
        if self.damaged or not self.recent:
            return None
        known = dict(self.recent)
        for step, time in lines[-len(self.recent):] if self.closed else lines:
            if not self.closed and step not in known:
                continue
            side = known.get(step)
            if side is None or not (time == side or (time is None and math.isnan(side))):
                return (f"the run log's line of step {step} disagrees with {self.path} (the newest collects "
                        f"there: {', '.join(str(s) for s, _ in self.recent)}): a damaged line")
        return None


_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def _collects(batch: Any) -> list[tuple[int, float]]:
    """(step, time) of each collect of a decoded batch, in collect order."""
    collect = batch.column(batch.schema.get_field_index("collect")).to_numpy()
    _, first = np.unique(collect, return_index=True)
    steps = batch.column(batch.schema.get_field_index("step")).to_numpy()[first]
    times = batch.column(batch.schema.get_field_index("time")).to_numpy()[first]
    return [(int(s), float(t)) for s, t in zip(steps.tolist(), times.tolist(), strict=True)]


def _last_collect(batch: Any) -> tuple[int, dict[str, list[float | None]]] | None:
    """(step, per-rank values by key) of the batch's last collect with per-rank values."""
    collect = batch.column(batch.schema.get_field_index("collect")).to_numpy()
    valid = batch.column(batch.schema.get_field_index("ranks")).is_valid().to_numpy(zero_copy_only=False)
    if not valid.any():
        return None
    last = collect[np.flatnonzero(valid)[-1]]
    rows = np.flatnonzero((collect == last) & valid)
    keys = batch.column(batch.schema.get_field_index("key")).to_pylist()
    ranks = batch.column(batch.schema.get_field_index("ranks"))
    step = int(batch.column(batch.schema.get_field_index("step"))[int(rows[0])].as_py())
    out: dict[str, list[float | None]] = {}
    for row in rows.tolist():
        values = ranks[row].values.to_numpy(zero_copy_only=False)
        out[keys[row]] = [None if not np.isfinite(v) else float(v) for v in values]
    return step, out
