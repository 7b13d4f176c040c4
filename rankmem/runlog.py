"""The JSONL run log: the source of truth for ``rankmem report``, ``plot`` and ``leaks``.

Line 1 is the header (``kind: "header"``, ``schema``, versions, world size, per-rank host and device,
config); then one ``kind: "step"`` line per logged step with the aggregated metrics and the per-rank
vectors. Non-finite numbers are written as ``null``. Each line is written whole and flushed, so a
crash loses at most the line being written, and readers skip a truncated last line.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import numpy as np

from rankmem._records import RunHeader, StepRecord
from rankmem._scalars import json_safe
from rankmem.errors import RankmemError, warn

SCHEMA = 1
RUN_LOG_NAME = "rankmem.jsonl"


def _rotate(path: str) -> str | None:
    """Move an existing non-empty log aside (``rankmem.jsonl.1``, ``.2``, ...) so that a restarted job
    with the same ``out_dir`` never truncates the records of the run before it."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return None
    n = 1
    while os.path.exists(f"{path}.{n}"):
        n += 1
    os.replace(path, f"{path}.{n}")
    return f"{path}.{n}"


def header_to_json(header: RunHeader) -> dict[str, Any]:
    from rankmem import __version__

    try:
        import torch

        torch_version: str | None = str(torch.__version__)
    except ImportError:
        torch_version = None
    return {
        "kind": "header",
        "schema": SCHEMA,
        "rankmem": __version__,
        "torch": torch_version,
        "world_size": header.world_size,
        "started": header.started,
        "ranks": [asdict(r) for r in header.ranks],
        "config": header.config,
    }


class RunLogWriter:
    """Appends whole, flushed lines to ``path``; the header is written once, by :meth:`open`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def open(self, header: RunHeader) -> None:
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        rotated = _rotate(self.path)
        self._file = open(self.path, "w", encoding="utf-8")
        self._write_line(json_safe(header_to_json(header)))
        if rotated:
            warn(f"rankmem: {self.path} existed (a restarted job?); kept it as {rotated}")

    def _write_line(self, obj: dict[str, Any]) -> None:
        assert self._file is not None, "RunLogWriter.open() must come first"
        # One write() of the whole line, then flush: a reader never sees half a line but for a crash.
        # default=str: the caller's config may hold paths; they become strings, not a lost header.
        self._file.write(json.dumps(obj, allow_nan=False, separators=(",", ":"), default=str) + "\n")
        self._file.flush()

    def write(self, record: StepRecord) -> None:
        assert self._file is not None, "RunLogWriter.open() must come first"
        # Hot path: encode as is, and only when the text holds a non-finite token (NaN, Infinity,
        # which JSON lacks) rebuild the record with nulls. Checking every value in Python first cost
        # more than the encoding itself.
        raw = {"kind": "step", "step": record.step, "time": record.time, "metrics": record.metrics, "ranks": record.ranks}
        line = json.dumps(raw, separators=(",", ":"))
        if "NaN" in line or "Infinity" in line:
            line = json.dumps(json_safe(raw), allow_nan=False, separators=(",", ":"))
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# ---- reader -------------------------------------------------------------------------------------------

SUPPORTED_SCHEMAS = (1,)

# A step line as RunLogWriter writes it: the aggregated metrics come before the per-rank vectors, which
# close the line. The aggregates are a function of those vectors, so the fast path parses only the
# ``"ranks"`` object (about half the line); anything else goes through a full json.loads.
_STEP_PREFIX = '{"kind":"step","step":'
_RANKS_MARK = ',"ranks":{'
# Rows per numpy block. Pending values wait as one flat list of floats per key set (floats are not tracked
# by the cyclic GC); 256 rows x 28 keys x 8 ranks is ~1.8 MiB of them, small enough to stay in a core's L2
# cache. Larger chunks (1024, 4096) measured no faster.
_CHUNK = 256
_NUMBER_TYPES = {float, int, type(None)}


@dataclass
class Run:
    """A run log read into arrays: one row per logged step, one column per rank.

    ``series[K]`` is a float64 array of shape ``(len(steps), world_size)`` holding the per-rank values of
    key ``K``; ``nan`` where a step or a rank lacks it. ``metrics`` holds the aggregated keys (one value
    per step) only when read with ``metrics=True``.
    """

    path: str
    header: dict[str, Any]
    steps: np.ndarray
    """Step numbers, int64, in file order."""
    times: np.ndarray
    """Unix times of the collects, float64."""
    series: dict[str, np.ndarray]
    corrupt_lines: list[int] = field(default_factory=list)
    """1-based line numbers that did not parse (or were not a step) and were skipped."""
    truncated: bool = False
    """True when the last line was cut short (a crash mid-write) and skipped."""
    metrics: dict[str, np.ndarray] | None = None

    @property
    def world_size(self) -> int:
        return int(self.header.get("world_size") or 0)

    @property
    def corrupt(self) -> int:
        return len(self.corrupt_lines)

    def phases(self) -> list[str]:
        """Names of the phases with keys in the log (``mem/phase/<name>/...``), sorted."""
        return sorted({k.split("/")[2] for k in self.series if k.startswith("mem/phase/") and k.count("/") >= 3})


def resolve_run_path(path: str) -> str:
    """A run directory or the ``.jsonl`` itself -> the run log's path; RankmemError when there is none."""
    if os.path.isdir(path):
        candidate = os.path.join(path, RUN_LOG_NAME)
        if not os.path.isfile(candidate):
            raise RankmemError(f"no run log in {path}: expected {candidate} (the Monitor writes it with sinks=('jsonl',))")
        return candidate
    if not os.path.isfile(path):
        raise RankmemError(f"no run log at {path}: pass a run directory holding {RUN_LOG_NAME}, or the .jsonl file")
    return path


def _parse_header(first: str, path: str) -> dict[str, Any]:
    try:
        header = json.loads(first)
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("kind") != "header":
        raise RankmemError(
            f"{path} has no header line: its first line must be a rankmem run log header "
            '({"kind":"header",...}); is this a rankmem.jsonl file?'
        )
    schema = header.get("schema")
    if schema not in SUPPORTED_SCHEMAS:
        supported = ", ".join(str(s) for s in SUPPORTED_SCHEMAS)
        raise RankmemError(
            f"{path} has run log schema {schema!r}; this rankmem reads schema {supported}: "
            "read it with the rankmem version that wrote it (see the header's 'rankmem' field)"
        )
    return header


def _fast_step(line: str) -> tuple[int, float, dict[str, Any]] | None:
    """(step, time, ranks) of a line in the writer's own layout, or None to take the slow path."""
    if not line.startswith(_STEP_PREFIX) or not line.endswith("}\n"):
        return None
    cut = line.find(_RANKS_MARK)  # a JSON string cannot hold it (its quotes would be escaped)
    if cut < 0:
        return None
    comma = line.find(",", len(_STEP_PREFIX))
    head = line[len(_STEP_PREFIX) : comma]
    rest = line[comma + 1 : line.find(",", comma + 1)]
    if not rest.startswith('"time":'):
        return None
    try:
        ranks = json.loads(line[cut + len(_RANKS_MARK) - 1 : -2])
        step, time_ = int(head), float(rest[7:])
    except ValueError:
        return None
    if not isinstance(ranks, dict):
        return None
    return step, time_, ranks


class _Columns:
    """Per-rank vectors collected row by row into ``(steps, world)`` float64 arrays, one per key.

    Rows whose vectors are all of length ``world`` go into one flat list of numbers per key set (in
    practice one or a few key sets per run); every :data:`_CHUNK` rows those lists become numpy blocks.
    Why plain floats rather than the parsed dicts and lists: live containers are what the cyclic GC
    scans. Holding 4096 rows x 28 per-rank lists between flushes, the reader ran ~4,000 collections on
    the 100k-step bench log (the plain json loop: none) and gc.disable() cut its time by a quarter.
    Anything else (ragged vectors, non-list values) is kept row by row in ``_odd``.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self.rows = 0
        self._pending_rows = 0
        self._pending: dict[tuple[str, ...], tuple[list[int], list[Any]]] = {}
        self._blocks: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._odd: dict[str, list[tuple[int, Any]]] = {}

    def add(self, ranks: dict[str, Any]) -> None:
        row = self.rows
        self.rows += 1
        vectors = ranks.values()
        try:
            regular = set(map(len, vectors)) == {self.world}
        except TypeError:  # a number or null where a vector belongs
            regular = False
        if regular:
            keys = tuple(ranks)
            group = self._pending.get(keys)
            if group is None:
                group = self._pending[keys] = ([], [])
            group[0].append(row)
            group[1].extend(itertools.chain.from_iterable(vectors))
            self._pending_rows += 1
            if self._pending_rows >= _CHUNK:
                self._flush()
        else:
            for key, vec in ranks.items():
                self._odd.setdefault(key, []).append((row, vec))

    def _flush(self) -> None:
        for keys, (rows, flat) in self._pending.items():
            self._blocks_of(keys, rows, flat)
        self._pending.clear()
        self._pending_rows = 0

    def _blocks_of(self, keys: tuple[str, ...], rows: list[int], flat: list[Any]) -> None:
        try:
            values = np.fromiter(flat, dtype=float, count=len(flat))
        except (TypeError, ValueError):
            if set(map(type, flat)) <= _NUMBER_TYPES:
                values = np.array(flat, dtype=float)  # nulls (None) become nan
            else:  # strings, nested lists...: nan, as on the slow path (bools count as ints there too)
                values = np.array([_num(v) for v in flat], dtype=float)
        block = values.reshape(len(rows), len(keys), self.world)
        index = np.asarray(rows, dtype=np.intp)
        for i, key in enumerate(keys):
            self._blocks.setdefault(key, []).append((index, block[:, i]))

    def arrays(self) -> dict[str, np.ndarray]:
        self._flush()
        series: dict[str, np.ndarray] = {}
        for key in [*self._blocks, *self._odd]:
            series.setdefault(key, np.full((self.rows, self.world), np.nan))
        for key, parts in self._blocks.items():
            for index, block in parts:
                series[key][index] = block
        for key, cells in self._odd.items():
            out = series[key]
            for row, vec in cells:
                if isinstance(vec, list):  # ragged: keep what fits, nan elsewhere
                    for r, v in enumerate(vec[: self.world]):
                        out[row, r] = _num(v)
        return series


def read_run(path: str, *, metrics: bool = False) -> Run:
    """Read a run log (a run directory or the ``.jsonl`` path) into a :class:`Run`.

    Corrupt lines are skipped and counted; a truncated last line is skipped and flagged. An empty file,
    a missing header and an unknown schema raise :class:`RankmemError`. ``metrics=True`` also parses the
    aggregated keys of every line (a full parse, about three times slower).
    """
    path = resolve_run_path(path)
    steps: list[int] = []
    times: list[float] = []
    aggs: dict[str, tuple[list[int], list[Any]]] = {}
    corrupt: list[int] = []
    truncated = False
    with open(path, encoding="utf-8", errors="replace") as f:
        first = f.readline()
        if not first.strip():
            raise RankmemError(f"{path} is empty: the run wrote no header (a run log starts at the first collect())")
        header = _parse_header(first, path)
        world = int(header.get("world_size") or 0)
        columns = _Columns(world)
        for lineno, line in enumerate(f, start=2):
            parsed = None if metrics else _fast_step(line)
            if parsed is None:
                if not line.rstrip("\r\n"):
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:
                    obj = None
                if not (
                    isinstance(obj, dict)
                    and obj.get("kind") == "step"
                    and isinstance(obj.get("ranks"), dict)
                    and isinstance(obj.get("step"), int)
                ):
                    if line.endswith("\n"):
                        corrupt.append(lineno)
                    else:
                        truncated = True
                    continue
                parsed = (obj["step"], _num(obj.get("time")), obj["ranks"])
                agg = obj.get("metrics")
                if isinstance(agg, dict):
                    for key, value in agg.items():
                        a = aggs.get(key)
                        if a is None:
                            a = aggs[key] = ([], [])
                        a[0].append(columns.rows)
                        a[1].append(value)
            steps.append(parsed[0])
            times.append(parsed[1])
            columns.add(parsed[2])
    n = len(steps)
    agg_arrays: dict[str, np.ndarray] | None = None
    if metrics:
        agg_arrays = {}
        for key, (rows, values) in aggs.items():
            out = np.full(n, np.nan)
            out[np.asarray(rows, dtype=np.intp)] = np.array([_num(v) for v in values], dtype=float)
            agg_arrays[key] = out
    return Run(
        path=path,
        header=header,
        steps=np.asarray(steps, dtype=np.int64),
        times=np.asarray(times, dtype=np.float64),
        series=columns.arrays(),
        corrupt_lines=corrupt,
        truncated=truncated,
        metrics=agg_arrays,
    )


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) else math.nan
