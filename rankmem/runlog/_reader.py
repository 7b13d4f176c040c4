"""The run-log reader: a run log into numpy arrays, one row per logged step and one column per rank.

Lines in the writer's own layout (:mod:`rankmem.runlog._layout`) take the fast path: only the per-rank
object is parsed. Anything else (another writer's layout, ``metrics=True``) takes the slow path, a full
``json.loads`` of the line. Corrupt lines are skipped and counted, a truncated last line is skipped and
flagged. Offline code: it needs numpy, never torch.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rankmem._catalogue import phase_names
from rankmem._scalars import to_float_or_nan
from rankmem.errors import RankmemError
from rankmem.runlog._layout import HEADER_KIND, RUN_LOG_NAME, STEP_KIND, SUPPORTED_SCHEMAS, split_step

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
    slow_lines: int = 0
    """Step lines read by a full ``json.loads``: those not in the writer's layout, or every one with
    ``metrics=True``. 0 for a log RunLogWriter wrote, read without metrics."""

    @property
    def world_size(self) -> int:
        return int(self.header.get("world_size") or 0)

    @property
    def corrupt(self) -> int:
        return len(self.corrupt_lines)

    def phases(self) -> list[str]:
        """Names of the phases with keys in the log (``mem/phase/<name>/...``), sorted."""
        return phase_names(self.series)


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
    if not first.strip():
        raise RankmemError(f"{path} is empty: the run wrote no header (a run log starts at the first collect())")
    try:
        header = json.loads(first)
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("kind") != HEADER_KIND:
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
    split = split_step(line)
    if split is None:
        return None
    try:
        ranks = json.loads(split[2])
    except ValueError:
        return None
    return (split[0], split[1], ranks) if isinstance(ranks, dict) else None


def _slow_step(line: str) -> dict[str, Any] | None:
    """A step line of any layout, fully parsed; None when it is not one."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if (
        isinstance(obj, dict)
        and obj.get("kind") == STEP_KIND
        and isinstance(obj.get("ranks"), dict)
        and isinstance(obj.get("step"), int)
    ):
        return obj
    return None


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
            else:  # strings, nested lists...: nan, as on the slow path (bools count as numbers there too)
                values = np.array([to_float_or_nan(v) for v in flat], dtype=float)
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
                        out[row, r] = to_float_or_nan(v)
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
        parsed = None if self.metrics else _fast_step(line)
        if parsed is None:
            if not line.rstrip("\r\n"):
                return
            obj = _slow_step(line)
            if obj is None:
                if line.endswith("\n"):
                    self.corrupt.append(lineno)
                else:
                    self.truncated = True
                return
            self.slow += 1
            parsed = (obj["step"], to_float_or_nan(obj.get("time")), obj["ranks"])
            if isinstance(obj.get("metrics"), dict):
                self._add_aggregates(obj["metrics"])
        self.steps.append(parsed[0])
        self.times.append(parsed[1])
        self.columns.add(parsed[2])

    def _add_aggregates(self, metrics: dict[str, Any]) -> None:
        row = self.columns.rows
        for key, value in metrics.items():
            a = self.aggregates.get(key)
            if a is None:
                a = self.aggregates[key] = ([], [])
            a[0].append(row)
            a[1].append(value)

    def run(self, path: str, header: dict[str, Any]) -> Run:
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
    """Read a run log (a run directory or the ``.jsonl`` path) into a :class:`Run`.

    Corrupt lines are skipped and counted; a truncated last line is skipped and flagged. An empty file,
    a missing header and an unknown schema raise :class:`RankmemError`. ``metrics=True`` also parses the
    aggregated keys of every line (a full parse, about three times slower).
    """
    path = resolve_run_path(path)
    with open(path, encoding="utf-8", errors="replace") as f:
        header = _parse_header(f.readline(), path)
        lines = _Lines(int(header.get("world_size") or 0), metrics)
        for lineno, line in enumerate(f, start=2):
            lines.add(lineno, line)
    return lines.run(path, header)
