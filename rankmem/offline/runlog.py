"""The run-log reader: a run log and its side file (:mod:`rankmem.runlog.layout`) into numpy arrays.

The side file is memory-mapped and each run of records of one key set copied once into
``series[key][row, rank]``; every record's checksum is checked, and reading stops at the first record cut
short (flagged) or damaged (named in :attr:`Run.detail_note`), never misread. The JSON lines are parsed
only where needed (``metrics=True``, collects without per-rank values, collects past the side file).
Reading raises nothing but :class:`RankmemError`, about the log as a whole. Offline code: no torch.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import mmap
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any, cast

import numpy as np

from rankmem.core.catalogue import phase_names
from rankmem.core.records import RunHeader
from rankmem.core.rundir import detail_name, is_regular, kind_of, open_binary, open_regular
from rankmem.core.scalars import to_float_or_nan
from rankmem.errors import RankmemError
from rankmem.runlog import layout as L
from rankmem.runlog.header import header_from_json

_COMPRESSED = {b"BZh": ("bzip2", "bunzip2"), b"\xfd7zXZ\x00": ("xz", "unxz"), b"\x28\xb5\x2f\xfd": ("zstd", "unzstd")}
MAX_HEADER = 1 << 24  # bytes of a header line read at most (a header is a few KB per rank)


def _loads(data: bytes | str) -> Any:
    """``data`` as JSON; None where it is not JSON or is nested past the interpreter's depth."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


@dataclass(frozen=True)
class Gap:
    """Collects the run log had to drop, as its GAP record and gap line name them."""

    first: int
    last: int
    count: int
    why: str

    def __str__(self) -> str:
        span = f"step {self.first}" if self.first == self.last else f"steps {self.first}..{self.last}"
        return f"{self.count} collect(s) not logged ({span}): {self.why}"


@dataclass
class Logged:
    """Every collect's step, time and aggregates (``K/max``... per collect, NaN where it lacks ``K``)."""

    steps: np.ndarray
    times: np.ndarray
    metrics: dict[str, np.ndarray]


@dataclass
class Run:
    """A run log read into arrays: one row per collect with per-rank values (``steps``: int64, ``times``:
    unix float64), ``series[K]`` of shape ``(len(steps), world_size)``, NaN where absent. ``metrics``:
    the aggregates per row, with ``metrics=True``. ``logged``: every collect (from the lines), when some
    carry no per-rank values. ``corrupt_lines``: 1-based numbers of lines read that were not a step;
    ``truncated``: a last line or record cut short; ``slow_lines``: lines parsed; ``detail_note``: why
    the per-rank values are partial; ``gaps``: collects the run log says it dropped."""

    path: str
    header: RunHeader
    steps: np.ndarray
    times: np.ndarray
    series: dict[str, np.ndarray]
    corrupt_lines: list[int] = field(default_factory=list)
    truncated: bool = False
    metrics: dict[str, np.ndarray] | None = None
    slow_lines: int = 0
    logged: Logged | None = None
    detail_note: str | None = None
    gaps: list[Gap] = field(default_factory=list)

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
    (or it is not a regular file). In a directory, ``rankmem.jsonl`` first, then ``rankmem.jsonl.gz``."""
    missing = f"no run log at {path}: pass a run directory holding {L.RUN_LOG_NAME}, or the .jsonl file"
    if os.path.isdir(path):
        candidate = os.path.join(path, L.RUN_LOG_NAME)
        if not os.path.lexists(candidate) and is_regular(candidate + ".gz"):
            return candidate + ".gz"
        missing = f"no run log in {path}: expected {candidate} (the Monitor writes it with sinks=('jsonl',))"
        path = candidate
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        raise RankmemError(missing) from None
    if not is_regular(path):
        raise RankmemError(f"{path} is {kind_of(mode)}, not a regular file: a run log must be a file "
                           "the run wrote; move it aside")
    return path


@contextlib.contextmanager
def open_log(path: str) -> Iterator[IO[bytes]]:
    """The log's bytes: plain, or gunzipped (by its magic bytes, whatever its name)."""
    handle = open_binary(path)
    try:
        magic = handle.peek(6)[:6]
        for prefix, (name, tool) in _COMPRESSED.items():
            if magic.startswith(prefix):
                raise RankmemError(f"{path} is {name}-compressed: rankmem reads plain and gzip'd run logs; "
                                   f"decompress it first ({tool} -k {path})")
        if magic[:2] == b"\x1f\x8b":
            with gzip.GzipFile(fileobj=handle, mode="rb") as unzipped:
                yield cast(IO[bytes], unzipped)
        else:
            yield handle
    except (gzip.BadGzipFile, zlib.error) as exc:
        raise RankmemError(f"{path}: the gzip stream is damaged ({exc}); recompress the log from its "
                           "source, or gunzip what can be read of it") from None
    finally:
        handle.close()


def side_path_of(log_path: str) -> str:
    """The side file of the log at ``log_path``, by the log's name, not by what its header says (a damaged
    header must not send the reader elsewhere): ``rankmem.jsonl.2.gz`` -> ``rankmem.ranks.f64.2``."""
    directory, base = os.path.split(log_path)
    base = base[: -len(".gz")] if base.endswith(".gz") else base
    stem, _, suffix = base.rpartition(".")
    if not (suffix.isdigit() and stem):
        stem, suffix = base, ""
    return os.path.join(directory, detail_name(stem) + (f".{suffix}" if suffix else ""))


class NoHeader(RankmemError):
    """The log's first line is not a header line (the follower waits for one)."""


def parse_header(first: bytes, path: str) -> RunHeader:
    """The header line's :class:`RunHeader`; :class:`NoHeader` when the line is not one, RankmemError
    when the header is damaged."""
    if not first.strip():
        raise NoHeader(f"{path} is empty: the run wrote no header (a run log starts at the first collect())")
    obj = _loads(first)
    if not isinstance(obj, dict) or obj.get("kind") != L.HEADER_KIND:
        raise NoHeader(f"{path} has no header line: its first line must be a rankmem run log header "
                           '({"kind":"header",...}); is this a rankmem.jsonl file?')
    return header_from_json(obj, path)


def step_of(line: bytes | str, kind: str = L.STEP_KIND) -> dict[str, Any] | None:
    """A step (or ``kind``) line's object, or None when the line is not one (not JSON, a non-integer step...)."""
    obj = _loads(line)
    steps = ("step",) if kind == L.STEP_KIND else ("first", "last", "count")
    if not isinstance(obj, dict) or obj.get("kind") != kind or any(type(obj.get(k)) is not int for k in steps):
        return None
    if not all(L.STEP_MIN <= obj[k] <= L.STEP_MAX for k in steps) or not isinstance(obj.get("metrics", {}), dict):
        return None
    return obj


GAP_LINE = b'{"kind":"gap"'
"""How the writer's gap lines start: readers skip them unparsed where the side file's GAP records serve."""


def unheld(lines: list[bytes]) -> bool:
    """Whether ``lines`` (whole, past the side file's newest collect's) hold any but gap lines."""
    return any(x.strip() and not x.startswith(GAP_LINE) for x in lines)


@dataclass
class SideFile:
    """The records walked so far (:func:`walk`); ``offsets``: per collect, where its line starts."""

    world: int
    key_sets: dict[int, list[str]] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    runs: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    """Runs of collects with per-rank values, adjacent in the file and of one key set: (index of the first
    collect, collects, byte offset of its world x K block, bytes from one record to the next, key set)."""
    gaps: list[Gap] = field(default_factory=list)
    end: int = L.FILE_HEADER.size  # where the next record starts
    truncated: bool = False
    damaged: str | None = None


def header_note(data: bytes, path: str, header_line: bytes | None) -> str | None:
    """A note when the log's header line is not the one the side file was written with (a damaged line:
    its per-rank values are still the run's), else None."""
    if header_line is None or L.FILE_HEADER.unpack_from(data)[4] == zlib.crc32(header_line):
        return None
    return f"the run log's header line does not match {path}'s record of it: damaged or edited"


def check_file_header(data: bytes, path: str, header: RunHeader) -> str | None:
    """Why the side file's header (``data``, whole: the callers check its size) does not belong to
    ``header``'s log, or None."""
    magic, version, world, run_id, _ = L.FILE_HEADER.unpack_from(data)
    if magic != L.MAGIC or version != L.VERSION:
        return f"{path} is not a rankmem per-rank file of version {L.VERSION}"
    if world != header.world_size:
        return f"{path} is for {world} ranks, the run log for {header.world_size}: another run's file"
    # A header whose run id is damaged or missing cannot refuse its side file: the world size must do.
    if header.run_id is not None and run_id != header.run_id.encode("ascii"):
        return f"{path} is from another run (its run id is not the log's): skipped, no per-rank values"
    return None


def walk(data: Any, size: int, side: SideFile) -> None:
    """Read the whole records of ``data[side.end:size]`` into ``side``: stops at a record cut short
    (:attr:`SideFile.truncated`) or damaged (:attr:`SideFile.damaged`, never read past)."""
    off, problem = side.end, ""
    while off < size and not problem:
        kind, n = L.RECORD_HEAD.unpack_from(data, off) if off + 16 <= size else (0, 0)
        end = off + 16 + 8 * n
        if off + 16 > size or (n <= L.MAX_WORDS and kind in (L.KEYS, L.COLLECT, L.GAP) and end + 8 > size):
            side.truncated = True
            break
        if n > L.MAX_WORDS or kind not in (L.KEYS, L.COLLECT, L.GAP):
            problem = f" (kind {kind}, {n} words)"
        elif L.checksums(np.ndarray(n + 2, "<u8", data, off)) != int.from_bytes(data[end : end + 8], "little"):
            problem = ": its checksum does not match"
        elif kind == L.COLLECT:
            taken = _collects(data, off, size, n, side)
            off, problem = off + taken, "" if taken else ": its per-rank block does not match its key set"
            continue
        elif kind == L.KEYS and n >= 2:
            key_set, length = L.KEYS_HEAD.unpack_from(data, off + 16)
            names = _loads(bytes(data[off + 32 : off + 32 + min(length, 8 * n - 16)]))
            if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
                problem = ": its key set is not a list of names"
            else:
                side.key_sets[key_set] = names
        elif kind == L.GAP and n >= 4:
            first, last, count, length = L.GAP_HEAD.unpack_from(data, off + 16)
            why = bytes(data[off + 48 : off + 48 + min(length, 8 * n - 32)]).decode("utf-8", "replace")
            side.gaps.append(Gap(first, last, count, why))
        else:
            problem = ": it is too short for its kind"
        off = off if problem else end + 8
    side.damaged = f"the record at byte {off} is damaged{problem}" if problem else None
    side.end = off


def _collects(data: Any, off: int, size: int, n: int, side: SideFile) -> int:
    """The bytes of the run of whole collect records of one size and key set from ``off`` (whose checksum
    is checked), taken into ``side`` as numpy columns: a long run's records cost no Python each. 0 when
    the first one's per-rank block does not fit its key set."""
    size_of = 16 + 8 * n + 8
    if n < 5:
        return 0
    words = np.ndarray(((size - off) // size_of, size_of // 8), dtype="<u8", buffer=data, offset=off)
    key_set, k = int(words[0, 5]), int(words[0, 6])
    names = side.key_sets.get(key_set) if k else []
    if names is None or len(names) != k or n != 5 + side.world * k:
        return 0
    same = (words[:, 0] == L.COLLECT) & (words[:, 1] == n) & (words[:, 5] == key_set) & (words[:, 6] == k)
    count = len(same) if same.all() else int(np.argmin(same))
    bad = L.checksums(words[:count, :-1]) != words[:count, -1]
    count = int(np.argmax(bad)) if bad.any() else count  # the bad one is judged on its own, next
    if k:
        side.runs.append((len(side.steps), count, off + 56, size_of, key_set))
    side.steps += words[:count, 2].view(np.int64).tolist()
    side.times += words[:count, 3].view(np.float64).tolist()
    side.offsets += words[:count, 4].tolist()
    return count * size_of


@contextlib.contextmanager
def mapped(fd: int, size: int) -> Iterator[memoryview]:
    """``fd``'s first ``size`` (> 0) bytes mapped read-only; on exit the view released, ``fd`` closed."""
    try:
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as whole, memoryview(whole) as view:
            yield view
    finally:
        os.close(fd)


def _read_side(path: str, header: RunHeader, header_line: bytes) -> tuple[SideFile, dict[str, np.ndarray], str | None]:
    """The side file's records and per-rank series; a note when it is missing or not this log's."""
    side = SideFile(header.world_size)
    try:
        fd = open_regular(path)
        size = os.fstat(fd).st_size
    except OSError as exc:
        why = "is missing" if isinstance(exc, FileNotFoundError) else f"cannot be read ({exc})"
        return side, {}, f"{path} {why}: no per-rank values; the aggregates are read from the run log's lines"
    if size < L.FILE_HEADER.size:
        os.close(fd)
        return side, {}, f"{path} has no whole file header: no per-rank values"
    with mapped(fd, size) as view:
        head = bytes(view[: L.FILE_HEADER.size])
        if (note := check_file_header(head, path, header)) is not None:
            return side, {}, note
        walk(view, size, side)
        return side, _series(view, side), header_note(head, path, header_line)


def _series(view: memoryview, side: SideFile) -> dict[str, np.ndarray]:
    """``series[key][row, rank]`` from the mapped records: each run transposed out of the file in one
    copy (keys x ranks x collects); a run that is the whole file is the series as it is. Column-major: a
    reduction over steps or ranks then runs at memory speed, not a call per row of a few ranks."""
    rows = sum(run[1] for run in side.runs)
    series: dict[str, np.ndarray] = {}
    row = 0
    for _, count, start, stride, key_set in side.runs:
        keys = side.key_sets[key_set]
        cube = np.ndarray((count, side.world, len(keys)), dtype="<f8", buffer=view, offset=start,
                          strides=(stride, 8 * len(keys), 8))
        block = np.empty((len(keys), side.world, count))  # the mapping closes when this returns
        for c in range(0, count, 1024):  # by slices that stay in cache (at once: the file re-read per key)
            block[:, :, c : c + 1024] = cube[c : c + 1024].transpose(2, 1, 0)
        del cube
        if count == rows:
            return {key: block[j].T for j, key in enumerate(keys)}
        for j, key in enumerate(keys):
            if key not in series:
                series[key] = np.full((side.world, rows), np.nan).T
            series[key][row : row + count] = block[j].T
        row += count
    return dict(sorted(series.items()))


def read_run(path: str, *, metrics: bool = False) -> Run:
    """Read a run log (a run directory, the ``.jsonl`` path, or a gzip'd ``.jsonl.gz``) into a :class:`Run`.

    An empty file, a missing or damaged header, an unknown schema and a compressed file rankmem cannot
    open raise :class:`RankmemError`. ``metrics=True`` also parses the aggregates of every line.
    """
    path = resolve_run_path(path)
    with open_log(path) as f:
        first = f.readline(MAX_HEADER)
        header = parse_header(first, path)
        side_path = side_path_of(path)
        # The log's size before the side file is read: a live run's lines after it are not this reading's.
        end = None if isinstance(f, gzip.GzipFile) else os.fstat(f.fileno()).st_size
        side, series, note = _read_side(side_path, header, first)
        has = np.zeros(len(side.steps), dtype=bool)
        for run_of in side.runs:
            has[run_of[0] : run_of[0] + run_of[1]] = True
        # The lines the side file does not hold: after the last collect's own line (its gaps aside).
        try:
            start = f.seek(side.offsets[-1] if side.offsets else len(first))
            tail, cut = f.read(-1 if end is None else max(0, end - start)).split(b"\n"), False
        except EOFError:  # a gzip'd log cut short (compressed while still written)
            tail, cut = [b"", b""], True
        extra = unheld(tail[1 if side.offsets else 0 : -1])
        cut_short = side.truncated and extra  # a record goes before its line: damaged, or copied while written
        if side.damaged or cut_short:
            why = side.damaged or f"the record at byte {side.end} runs past the file's end"
            damage = (f"{side_path}: {why} after collect {len(side.steps)}; the later collects' aggregates come "
                      "from the run log's lines, without per-rank values")
            note = f"{note}; {damage}" if note else damage
        truncated = cut or side.truncated or bool(tail[-1].strip())
        lines = _Lines(f, len(first)) if metrics or extra or not has.all() else None
    detail = np.flatnonzero(has)
    run = Run(path=path, header=header, steps=np.asarray(side.steps, dtype=np.int64)[detail],
              times=np.asarray(side.times, dtype=np.float64)[detail], series=series, truncated=truncated,
              detail_note=note, gaps=side.gaps)
    if lines is not None:
        run.corrupt_lines, run.slow_lines = lines.corrupt, len(lines.steps)
        run.truncated = run.truncated or lines.truncated
        run.gaps += [g for g in lines.gaps if g not in side.gaps]  # the side file's, then the lines' own
        aggregates = lines.arrays()
        if len(lines.steps) > len(side.steps) or not has.all():
            run.logged = Logged(np.asarray(lines.steps, dtype=np.int64), np.asarray(lines.times), aggregates)
        if metrics:
            at = {o: i for i, o in enumerate(lines.offsets)}
            index = np.array([at.get(side.offsets[i], -1) for i in detail], dtype=np.intp)
            run.metrics = {k: np.where(index >= 0, v[index], np.nan) for k, v in aggregates.items()}
    return run


class _Lines:
    """Every step and gap line of a log from byte ``at``, parsed: steps, times, aggregates and each
    step line's byte offset."""

    def __init__(self, f: IO[bytes], at: int) -> None:
        self.steps: list[int] = []
        self.times: list[float] = []
        self.offsets: list[int] = []
        self.metrics: list[dict[str, Any]] = []
        self.corrupt: list[int] = []
        self.gaps: list[Gap] = []
        self.truncated = False
        f.seek(at)
        try:
            for lineno, raw in enumerate(f, start=2):
                obj = step_of(raw) if raw.endswith(b"\n") else None
                if obj is not None:
                    self.steps.append(obj["step"])
                    self.times.append(to_float_or_nan(obj.get("time")))
                    self.offsets.append(at)
                    self.metrics.append(obj.get("metrics") or {})
                elif raw.endswith(b"\n") and (gap := step_of(raw, L.GAP_KIND)) is not None:
                    self.gaps.append(Gap(gap["first"], gap["last"], gap["count"], str(gap.get("why"))))
                elif raw.strip():
                    self.corrupt += [lineno] if raw.endswith(b"\n") else []
                    self.truncated = self.truncated or not raw.endswith(b"\n")
                at += len(raw)
        except EOFError:  # a gzip'd log cut short (compressed while still written)
            self.truncated = True

    def arrays(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for i, metrics in enumerate(self.metrics):
            for key, value in metrics.items():
                if key not in out:
                    out[key] = np.full(len(self.metrics), np.nan)
                out[key][i] = to_float_or_nan(value)
        return out


def read_header_line(path: str) -> bytes | None:
    """The header line of ``path`` as written, newline included; None when missing or not yet whole."""
    try:
        with open_binary(path) as f:
            first = f.readline(MAX_HEADER)
    except OSError:
        return None
    return first if first.endswith(b"\n") else None
