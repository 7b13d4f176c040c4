"""The run-log reader: a run log into numpy arrays, one row per logged step and one column per rank.

Lines in the writer's own layout (:mod:`rankmem.runlog.layout`) take the fast path: only the per-rank
object is parsed. Anything else (another writer's layout, ``metrics=True``) takes the slow path, a full
``json.loads`` of the line. Both paths accept the same lines and file the same values.

The header line reads into the :class:`~rankmem.core.records.RunHeader` it was written from
(:func:`rankmem.runlog.header.header_from_json`: a damaged field other than those the arrays are shaped
by takes its default). Whatever the file holds, reading it never raises anything but
:class:`RankmemError` (about the file as a whole: no header, a header without a usable world size,
schema or detail) and never files a value under another step
or rank: a line that is not a whole step in the layout (not JSON, nested past the parser's depth, a
step outside int64, a per-rank vector whose length is not the world size) is skipped and its line
number kept in :attr:`Run.corrupt_lines`; a truncated last line is skipped and flagged. A torn line (a
crash mid-write) followed on the same physical line by a whole one is split where the whole one starts
(no JSON string can hold :data:`~rankmem.runlog.layout.STEP_PREFIX`): the torn part counts as
corrupt, the whole line is read. A gzip'd log (``rankmem.jsonl.gz``) is read as it is. Offline code: it
needs numpy, never torch.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import itertools
import json
import math
import os
import stat
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any, cast

import numpy as np

from rankmem.core.catalogue import phase_names
from rankmem.core.files import is_regular, kind_of, open_binary
from rankmem.core.records import RunHeader
from rankmem.core.scalars import to_float_or_nan
from rankmem.errors import MissingExtraError, RankmemError
from rankmem.offline.columnar import Detail, empty_detail, read_detail
from rankmem.runlog.header import header_from_json
from rankmem.runlog.layout import (
    DETAIL_AGGREGATES,
    HEADER_KIND,
    INLINE,
    RUN_LOG_NAME,
    STEP_KIND,
    STEP_MAX,
    STEP_MIN,
    STEP_PREFIX,
    detail_path,
    split_step,
)

# Rows per numpy block. Pending values wait as one flat list of floats per key set (floats are not tracked
# by the cyclic GC); 256 rows x 28 keys x 8 ranks is ~1.8 MiB of them, small enough to stay in a core's L2
# cache. Larger chunks (1024, 4096) measured no faster.
_CHUNK = 256
_NUMBER_TYPES = {float, int, type(None)}
_BAD_JSON = (ValueError, RecursionError)  # json.loads: not JSON; nested past the interpreter's depth
# Magic bytes of compressed files rankmem does not open itself, and the command that undoes each.
_COMPRESSED = {b"BZh": ("bzip2", "bunzip2"), b"\xfd7zXZ\x00": ("xz", "unxz"), b"\x28\xb5\x2f\xfd": ("zstd", "unzstd")}


@dataclass
class Logged:
    """Every collect of a run log, with or without per-rank values: step, time and aggregates."""

    steps: np.ndarray
    times: np.ndarray
    metrics: dict[str, np.ndarray]
    """``K/max``, ``K/min``, ``K/mean``, ``K/max_rank``, ``K/min_rank`` (and ``K/p50``... past the
    crossover) per collect; NaN where a collect lacks ``K``."""


@dataclass
class Run:
    """A run log read into arrays: one row per logged step, one column per rank.

    ``series[K]`` is a float64 array of shape ``(len(steps), world_size)`` holding the per-rank values of
    key ``K``; ``nan`` where a step or a rank lacks it. ``metrics`` holds the aggregated keys (one value
    per step) only when read with ``metrics=True``.
    """

    path: str
    header: RunHeader
    """The header, typed (:func:`rankmem.runlog.header.header_from_json`): what the run wrote it from."""
    steps: np.ndarray
    """Step numbers, int64, in file order."""
    times: np.ndarray
    """Unix times of the collects, float64."""
    series: dict[str, np.ndarray]
    corrupt_lines: list[int] = field(default_factory=list)
    """1-based line numbers that did not parse (or were not a step) and were skipped."""
    truncated: bool = False
    """True when the last line, or the side file's last batch, was cut short (a crash mid-write) and skipped."""
    metrics: dict[str, np.ndarray] | None = None
    slow_lines: int = 0
    """Step lines read by a full ``json.loads``: those not in the writer's layout, or every one with
    ``metrics=True``; for a log with a side file, the lines after its last batch. 0 for a log
    RunLogWriter wrote and closed, read without metrics."""
    logged: Logged | None = None
    """Every logged collect's step, time and aggregates, when some collects carry no per-rank values
    (past the all-reduce crossover, or the last second of a run that crashed): ``steps``, ``times`` and
    ``series`` then hold the collects that do. None when every collect does."""
    detail_note: str | None = None
    """Why the per-rank values are partial beyond :attr:`logged` (a damaged or missing side file)."""

    @property
    def world_size(self) -> int:
        return self.header.world_size

    @property
    def corrupt(self) -> int:
        return len(self.corrupt_lines)

    def phases(self) -> list[str]:
        """Names of the phases with keys in the log (``mem/phase/<name>/...``), sorted."""
        return phase_names(self.series)


def resolve_run_path(path: str) -> str:
    """A run directory or the ``.jsonl`` itself -> the run log's path; RankmemError when there is none
    (or it is not a regular file: a FIFO would block the read). In a directory, ``rankmem.jsonl`` is
    looked for first, then ``rankmem.jsonl.gz``."""
    if os.path.isdir(path):
        candidate = os.path.join(path, RUN_LOG_NAME)
        if not os.path.lexists(candidate) and is_regular(candidate + ".gz"):
            return candidate + ".gz"
        _regular_or_raise(candidate)
        if not is_regular(candidate):
            raise RankmemError(f"no run log in {path}: expected {candidate} (the Monitor writes it with sinks=('jsonl',))")
        return candidate
    _regular_or_raise(path)
    if not is_regular(path):
        raise RankmemError(f"no run log at {path}: pass a run directory holding {RUN_LOG_NAME}, or the .jsonl file")
    return path


def _regular_or_raise(path: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return
    if not stat.S_ISREG(mode):
        raise RankmemError(f"{path} is {kind_of(mode)}, not a regular file: a run log must be a file "
                           "the run wrote; move it aside")


@contextlib.contextmanager
def _open_log(path: str) -> Iterator[IO[str]]:
    """The log as text: plain, or gzip'd (by its magic bytes, whatever its name)."""
    with _open_bytes(path) as f:
        magic = f.peek(6)[:6] if isinstance(f, io.BufferedReader) else b""
        for prefix, (name, tool) in _COMPRESSED.items():
            if magic.startswith(prefix):
                raise RankmemError(f"{path} is {name}-compressed: rankmem reads plain and gzip'd run logs; "
                                   f"decompress it first ({tool} -k {path})")
        text = io.TextIOWrapper(cast(IO[bytes], f), encoding="utf-8", errors="replace")
        try:
            yield text
        finally:
            text.detach()


@contextlib.contextmanager
def _open_bytes(path: str) -> Iterator[io.BufferedIOBase]:
    """The log's bytes, gunzipped when it is gzip'd; opened as a regular file only (a FIFO swapped in
    since :func:`resolve_run_path` would block a plain open)."""
    handle = open_binary(path)
    try:
        if handle.peek(2)[:2] == b"\x1f\x8b":
            with gzip.GzipFile(fileobj=handle, mode="rb") as unzipped:
                yield unzipped
        else:
            yield handle
    finally:
        handle.close()


def _parse_header(first: str, path: str) -> RunHeader:
    if not first.strip():
        raise RankmemError(f"{path} is empty: the run wrote no header (a run log starts at the first collect())")
    try:
        obj = json.loads(first)
    except _BAD_JSON:
        obj = None
    if not isinstance(obj, dict) or obj.get("kind") != HEADER_KIND:
        raise RankmemError(
            f"{path} has no header line: its first line must be a rankmem run log header "
            '({"kind":"header",...}); is this a rankmem.jsonl file?'
        )
    return header_from_json(obj, path)


def _fast_step(line: str) -> tuple[int, float, dict[str, Any]] | None:
    """(step, time, ranks) of a line in the writer's own layout, or None to take the slow path."""
    split = split_step(line)
    if split is None:
        return None
    try:
        ranks = json.loads(split[2])
    except _BAD_JSON:
        return None
    return (split[0], split[1], ranks) if isinstance(ranks, dict) else None


def _slow_step(line: str, with_ranks: bool = True) -> dict[str, Any] | None:
    """A step line of any layout, fully parsed; None when it is not one (or, ``with_ranks``, when it holds
    no per-rank object: the lines of a log with a side file hold the aggregates only)."""
    try:
        obj = json.loads(line)
    except _BAD_JSON:
        return None
    if (
        isinstance(obj, dict)
        and obj.get("kind") == STEP_KIND
        and (not with_ranks or isinstance(obj.get("ranks"), dict))
        and type(obj.get("step")) is int  # not a bool
    ):
        return obj
    return None


class _Columns:
    """Per-rank vectors collected row by row into ``(steps, world)`` float64 arrays, one per key.

    A row is accepted only when every value is a vector of exactly ``world`` entries: a shorter or
    longer one cannot say which entry is whose rank, and cutting or padding it invented growth in the
    report. Accepted rows go into one flat list of numbers per key set (in practice one or a few key
    sets per run); every :data:`_CHUNK` rows those lists become numpy blocks. Why plain floats rather
    than the parsed dicts and lists: live containers are what the cyclic GC scans. Holding 4096 rows x
    28 per-rank lists between flushes, the reader ran ~4,000 collections on the 100k-step bench log (the
    plain json loop: none) and gc.disable() cut its time by a quarter.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self.rows = 0
        self._pending_rows = 0
        self._pending: dict[tuple[str, ...], tuple[list[int], list[Any]]] = {}
        self._blocks: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def add(self, ranks: dict[str, Any]) -> bool:
        """Take one row; False (nothing taken) when a value is not a vector of ``world`` entries."""
        vectors = ranks.values()
        if not all(type(v) is list and len(v) == self.world for v in vectors):
            return False
        row = self.rows
        self.rows += 1
        keys = tuple(ranks)
        group = self._pending.get(keys)
        if group is None:
            group = self._pending[keys] = ([], [])
        group[0].append(row)
        group[1].extend(itertools.chain.from_iterable(vectors))
        self._pending_rows += 1
        if self._pending_rows >= _CHUNK:
            self._flush()
        return True

    def _flush(self) -> None:
        for keys, (rows, flat) in self._pending.items():
            self._blocks_of(keys, rows, flat)
        self._pending.clear()
        self._pending_rows = 0

    def _blocks_of(self, keys: tuple[str, ...], rows: list[int], flat: list[Any]) -> None:
        # Types first: np.fromiter would also parse a string "7.5" as a number, where the slow path
        # (and a chunk holding a null beside it) reads it as absent.
        numbers = set(map(type, flat)) <= _NUMBER_TYPES
        try:
            if not numbers:
                raise TypeError
            values = np.fromiter(flat, dtype=float, count=len(flat))
        except (TypeError, ValueError, OverflowError):
            if numbers and not any(type(v) is int and abs(v) > 2**1023 for v in flat):
                values = np.array(flat, dtype=float)  # nulls (None) become nan
            else:  # strings, nested lists, ints past float64...: nan, as on the slow path (bools are numbers)
                values = np.array([to_float_or_nan(v) for v in flat], dtype=float)
        block = values.reshape(len(rows), len(keys), self.world)
        index = np.asarray(rows, dtype=np.intp)
        for i, key in enumerate(keys):
            self._blocks.setdefault(key, []).append((index, block[:, i]))

    def arrays(self) -> dict[str, np.ndarray]:
        self._flush()
        series: dict[str, np.ndarray] = {}
        for key, parts in self._blocks.items():
            out = series[key] = np.full((self.rows, self.world), np.nan)
            for index, block in parts:
                out[index] = block
        return series


class _Lines:
    """The step lines of one run log, line by line: fast path first, slow path when it does not fit."""

    def __init__(self, world: int, metrics: bool) -> None:
        self.metrics = metrics
        self.steps: list[int] = []
        self.times: list[float] = []
        self.columns = _Columns(world)
        self.aggregates: dict[str, tuple[list[int], list[Any]]] = {}
        self.corrupt: list[int] = []
        self.truncated = False
        self.slow = 0

    def add(self, lineno: int, line: str) -> None:
        parsed, obj = self._parse(line)
        if parsed is None:
            if not line.rstrip("\r\n"):
                return
            cut = line.rfind(STEP_PREFIX)
            if cut > 0:  # a torn line, then a whole one: the torn part is corrupt, the whole one is read
                self.corrupt.append(lineno)
                parsed, obj = self._parse(line[cut:])
            elif line.endswith("\n"):
                self.corrupt.append(lineno)
            if parsed is None:
                self.truncated = self.truncated or not line.endswith("\n")
                return
        step, time, ranks = parsed
        if not STEP_MIN <= step <= STEP_MAX or not self.columns.add(ranks):
            if not self.corrupt or self.corrupt[-1] != lineno:
                self.corrupt.append(lineno)
            return
        if obj is not None:
            self.slow += 1
            if isinstance(obj.get("metrics"), dict):
                self._add_aggregates(self.columns.rows - 1, obj["metrics"])
        self.steps.append(step)
        self.times.append(time if math.isfinite(time) else math.nan)

    def _parse(self, line: str) -> tuple[tuple[int, float, Any] | None, dict[str, Any] | None]:
        """(step, time, ranks) of a step line by the fast path, else the slow one (which also returns
        the parsed object); (None, None) when neither reads it."""
        parsed = None if self.metrics else _fast_step(line)
        if parsed is not None:
            return parsed, None
        obj = _slow_step(line)
        if obj is None:
            return None, None
        return (obj["step"], to_float_or_nan(obj.get("time")), obj["ranks"]), obj

    def _add_aggregates(self, row: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            a = self.aggregates.get(key)
            if a is None:
                a = self.aggregates[key] = ([], [])
            a[0].append(row)
            a[1].append(value)

    def run(self, path: str, header: RunHeader) -> Run:
        n = len(self.steps)
        agg_arrays: dict[str, np.ndarray] | None = None
        if self.metrics:
            agg_arrays = {}
            for key, (rows, values) in self.aggregates.items():
                out = np.full(n, np.nan)
                out[np.asarray(rows, dtype=np.intp)] = np.array([to_float_or_nan(v) for v in values], dtype=float)
                agg_arrays[key] = out
        return Run(
            path=path,
            header=header,
            steps=np.asarray(self.steps, dtype=np.int64),
            times=np.asarray(self.times, dtype=np.float64),
            series=self.columns.arrays(),
            corrupt_lines=self.corrupt,
            truncated=self.truncated,
            metrics=agg_arrays,
            slow_lines=self.slow,
        )


def read_run(path: str, *, metrics: bool = False) -> Run:
    """Read a run log (a run directory, the ``.jsonl`` path, or a gzip'd ``.jsonl.gz``) into a :class:`Run`.

    Corrupt lines are skipped and counted; a truncated last line is skipped and flagged. An empty file,
    a missing or damaged header, an unknown schema and a compressed file rankmem cannot open raise
    :class:`RankmemError`. ``metrics=True`` also parses the aggregated keys of every line (a full parse,
    about three times slower).
    """
    path = resolve_run_path(path)
    with _open_log(path) as f:
        lines_of = _NumberedLines(f, path)
        header = _parse_header(next(lines_of, (1, ""))[1], path)
        if header.detail is not None and header.detail != INLINE:
            return _read_columnar(path, header, header.detail, metrics)
        lines = _Lines(header.world_size, metrics)
        for lineno, line in lines_of:
            lines.add(lineno, line)
        lines.truncated = lines.truncated or lines_of.ended_early
    return lines.run(path, header)


class _NumberedLines:
    """``(line number, line)`` of ``f`` from 1; a gzip stream cut short (a log compressed while still
    being written, a partial copy) ends the lines there and sets :attr:`ended_early`."""

    def __init__(self, f: IO[str], path: str) -> None:
        self._lines: Iterator[tuple[int, str]] = enumerate(f, start=1)
        self._path = path
        self.ended_early = False

    def __iter__(self) -> _NumberedLines:
        return self

    def __next__(self) -> tuple[int, str]:
        try:
            return next(self._lines)
        except EOFError:
            self.ended_early = True
            raise StopIteration from None
        except (gzip.BadGzipFile, zlib.error) as exc:
            raise RankmemError(f"{self._path}: the gzip stream is damaged ({exc}); recompress the log from its "
                               "source, or gunzip what can be read of it") from None


def _read_columnar(path: str, header: RunHeader, name: str, metrics: bool) -> Run:
    """A schema-2 log: the per-rank values and aggregates from its side file, then the lines the side
    file does not hold yet (after its last batch's offset: a crash's last second) from the log."""
    world = header.world_size
    side = detail_path(path, name)
    detail: Detail | None = None
    note = None
    if not os.path.lexists(side):
        note = f"{side} is missing: no per-rank values; the aggregates are read from the run log's lines"
    elif not is_regular(side):
        note = (f"{side} is {kind_of(os.stat(side).st_mode)}, not a regular file: skipped, no per-rank values; "
                "the aggregates are read from the run log's lines")
    else:
        try:
            detail = read_detail(side, world, header.run_id, _first_line(path))
        except MissingExtraError:
            raise  # pyarrow is needed to read it: say so, rather than read the lines silently
        except RankmemError as exc:
            note = f"{exc}; the aggregates are read from the run log's lines"
    if detail is None:
        detail = empty_detail(world)
    elif detail.error:
        note = (f"{side} is damaged after collect {detail.steps.size} ({detail.error}); the later collects' "
                "aggregates come from the run log's lines, without per-rank values")
    tail = _Tail(path, detail.log_offset, first_lineno=2 + detail.steps.size)
    has = np.r_[detail.has_detail, np.zeros(len(tail.steps), dtype=bool)]
    steps = np.r_[detail.steps, np.asarray(tail.steps, dtype=np.int64)].astype(np.int64)
    times = np.r_[detail.times, np.asarray(tail.times, dtype=np.float64)]
    aggregates: dict[str, np.ndarray] | None = None
    if metrics or not has.all():
        aggregates = _merge_aggregates(detail.aggregates(), tail.metrics, detail.steps.size, len(tail.steps))
    logged = None if has.all() else Logged(steps, times, aggregates or {})
    return Run(
        path=path,
        header=header,
        steps=steps[has],
        times=times[has],
        series=detail.series(),
        corrupt_lines=tail.corrupt,
        truncated=tail.truncated or detail.truncated,
        metrics={k: v[has] for k, v in aggregates.items()} if metrics and aggregates is not None else None,
        slow_lines=len(tail.steps),
        logged=logged,
        detail_note=note,
    )


def _merge_aggregates(head: dict[str, np.ndarray], tail: list[dict[str, Any]], n_head: int, n_tail: int
                      ) -> dict[str, np.ndarray]:
    """The side file's aggregates followed by those of the lines after it, per name."""
    names = set(head)
    for metrics in tail:
        names.update(k for k in metrics if k.rsplit("/", 1)[-1] in DETAIL_AGGREGATES)
    out = {}
    for name in sorted(names):
        arr = np.full(n_head + n_tail, np.nan)
        if name in head:
            arr[:n_head] = head[name]
        for i, metrics in enumerate(tail):
            arr[n_head + i] = to_float_or_nan(metrics.get(name))
        out[name] = arr
    return out


class _Tail:
    """The step lines of a log from byte ``offset`` on (the header skipped when it is 0), fully parsed:
    steps, times and aggregates; corrupt lines counted (their numbers as the writer wrote them)."""

    def __init__(self, path: str, offset: int, first_lineno: int) -> None:
        self.steps: list[int] = []
        self.times: list[float] = []
        self.metrics: list[dict[str, Any]] = []
        self.corrupt: list[int] = []
        self.truncated = False
        with _open_bytes(path) as f:
            try:
                if offset:
                    f.seek(offset)
                else:
                    f.readline()  # the header
                    first_lineno = 2
                for lineno, raw in enumerate(f, start=first_lineno):
                    self._add(lineno, raw.decode("utf-8", errors="replace"))
            except EOFError:  # a gzip'd log cut short (compressed while still written)
                self.truncated = True
            except (gzip.BadGzipFile, zlib.error) as exc:
                raise RankmemError(f"{path}: the gzip stream is damaged ({exc}); recompress the log from its "
                                   "source, or gunzip what can be read of it") from None

    def _add(self, lineno: int, line: str) -> None:
        if not line.strip():
            return
        obj = _slow_step(line, with_ranks=False) if line.endswith("\n") else None
        if obj is None or not STEP_MIN <= obj["step"] <= STEP_MAX:
            if line.endswith("\n"):
                self.corrupt.append(lineno)
            else:
                self.truncated = True
            return
        metrics = obj.get("metrics")
        self.steps.append(obj["step"])
        self.times.append(to_float_or_nan(obj.get("time")))
        self.metrics.append(metrics if isinstance(metrics, dict) else {})


def _first_line(path: str) -> bytes | None:
    """The log's header line as written (newline included), for the side file's header check; None when
    it cannot be read."""
    try:
        with _open_bytes(path) as f:
            return f.readline(1 << 24)
    except (OSError, EOFError, zlib.error):
        return None
