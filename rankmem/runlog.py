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
from rankmem.errors import RankmemError

SCHEMA = 1
RUN_LOG_NAME = "rankmem.jsonl"


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


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


def record_to_json(record: StepRecord) -> dict[str, Any]:
    return {
        "kind": "step",
        "step": record.step,
        "time": record.time,
        "metrics": {k: _finite(v) for k, v in record.metrics.items()},
        "ranks": {k: [_finite(v) for v in vs] for k, vs in record.ranks.items()},
    }


class RunLogWriter:
    """Appends whole, flushed lines to ``path``; the header is written once, by :meth:`open`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def open(self, header: RunHeader) -> None:
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        self._file = open(self.path, "w", encoding="utf-8")
        self._write_line(header_to_json(header))

    def _write_line(self, obj: dict[str, Any]) -> None:
        assert self._file is not None, "RunLogWriter.open() must come first"
        # One write() of the whole line, then flush: a reader never sees half a line but for a crash.
        self._file.write(json.dumps(obj, allow_nan=False, separators=(",", ":")) + "\n")
        self._file.flush()

    def write(self, record: StepRecord) -> None:
        self._write_line(record_to_json(record))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# ---- reader -------------------------------------------------------------------------------------------

SUPPORTED_SCHEMAS = (1,)

# A step line as RunLogWriter writes it: the aggregated metrics come before the per-rank vectors, which
# close the line. The aggregates are a function of those vectors, so the fast path parses only the
# ``"ranks"`` object (about a third of the line); anything else goes through a full json.loads.
_STEP_PREFIX = '{"kind":"step","step":'
_RANKS_MARK = ',"ranks":{'
_CHUNK = 4096


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
    if not line.startswith(_STEP_PREFIX):
        return None
    cut = line.rfind(_RANKS_MARK)
    if cut < 0:
        return None
    comma = line.find(",", len(_STEP_PREFIX))
    head = line[len(_STEP_PREFIX) : comma]
    rest = line[comma + 1 : line.find(",", comma + 1)]
    if not rest.startswith('"time":'):
        return None
    try:
        ranks = json.loads(line[cut + 9 : -1]) if line.endswith("}") else None
        step, time_ = int(head), float(rest[7:])
    except ValueError:
        return None
    if not isinstance(ranks, dict):
        return None
    return step, time_, ranks


def read_run(path: str, *, metrics: bool = False) -> Run:
    """Read a run log (a run directory or the ``.jsonl`` path) into a :class:`Run`.

    Corrupt lines are skipped and counted; a truncated last line is skipped and flagged. An empty file,
    a missing header and an unknown schema raise :class:`RankmemError`. ``metrics=True`` also parses the
    aggregated keys of every line (a full parse, about three times slower).
    """
    path = resolve_run_path(path)
    steps: list[int] = []
    times: list[float] = []
    # key -> (row indices, per-rank vectors): arrays are built once, at the end.
    cols: dict[str, tuple[list[int], list[list[float | None]]]] = {}
    # Pending vectors become numpy blocks every _CHUNK rows: millions of live Python floats and lists
    # would cost gigabytes and make the cyclic GC rescan them again and again.
    blocks: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    aggs: dict[str, tuple[list[int], list[float | None]]] = {}
    corrupt: list[int] = []
    truncated = False
    with open(path, encoding="utf-8", errors="replace") as f:
        first = f.readline()
        if not first.strip():
            raise RankmemError(f"{path} is empty: the run wrote no header (a run log starts at the first collect())")
        header = _parse_header(first, path)
        world = int(header.get("world_size") or 0)
        lineno = 1
        for line in f:
            lineno += 1
            ended = line.endswith("\n")
            line = line.rstrip("\r\n")
            if not line:
                continue
            parsed = None if metrics else _fast_step(line)
            agg: Any = None
            if parsed is None:
                try:
                    obj = json.loads(line)
                except ValueError:
                    obj = None
                if (
                    isinstance(obj, dict)
                    and obj.get("kind") == "step"
                    and isinstance(obj.get("ranks"), dict)
                    and isinstance(obj.get("step"), int)
                ):
                    parsed = (obj["step"], _num(obj.get("time")), obj["ranks"])
                    agg = obj.get("metrics")
                else:
                    if ended:
                        corrupt.append(lineno)
                    else:
                        truncated = True
                    continue
            row = len(steps)
            if row and row % _CHUNK == 0:
                _flush(cols, blocks, world)
            steps.append(parsed[0])
            times.append(parsed[1])
            for key, vec in parsed[2].items():
                entry = cols.get(key)
                if entry is None:
                    entry = cols[key] = ([], [])
                entry[0].append(row)
                entry[1].append(vec)
            if isinstance(agg, dict):
                for key, value in agg.items():
                    a = aggs.get(key)
                    if a is None:
                        a = aggs[key] = ([], [])
                    a[0].append(row)
                    a[1].append(value)
    n = len(steps)
    _flush(cols, blocks, world)
    series: dict[str, np.ndarray] = {}
    for key, parts in blocks.items():
        out = series[key] = np.full((n, world), np.nan)
        for index, block in parts:
            out[index] = block
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
        series=series,
        corrupt_lines=corrupt,
        truncated=truncated,
        metrics=agg_arrays,
    )


def _flush(
    cols: dict[str, tuple[list[int], list[list[float | None]]]],
    blocks: dict[str, list[tuple[np.ndarray, np.ndarray]]],
    world: int,
) -> None:
    for key, (rows, vecs) in cols.items():
        if rows:
            blocks.setdefault(key, []).append(_block(rows, vecs, world))
    cols.clear()


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) else math.nan


def _block(rows: list[int], vecs: list[list[float | None]], world: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-rank vectors -> (row indices, a ``(len(rows), world)`` float64 block); None becomes nan."""
    index = np.asarray(rows, dtype=np.intp)
    if set(map(len, vecs)) == {world}:
        try:
            # The common case, all floats: fromiter is ~5x faster than np.array on nested lists.
            flat = np.fromiter(itertools.chain.from_iterable(vecs), dtype=float, count=len(vecs) * world)
            return index, flat.reshape(len(vecs), world)
        except (TypeError, ValueError):
            pass
    block = np.full((len(vecs), world), np.nan)
    for i, vec in enumerate(vecs):  # None, ragged or odd values: keep what fits, row by row
        if isinstance(vec, list):
            for r, v in enumerate(vec[:world]):
                block[i, r] = _num(v)
    return index, block
