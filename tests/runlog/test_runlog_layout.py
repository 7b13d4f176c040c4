"""The run-log layouts: the inline lines (schema 1's, still written without pyarrow) take the reader's fast
path, which agrees with the slow one; the columnar side file reads back as the inline lines do."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from rankmem.core.records import RankInfo, RunHeader, StepRecord
from rankmem.offline import read_run
from rankmem.runlog import RUN_LOG_NAME, RunLogWriter
from rankmem.runlog.layout import DETAIL_NAME, RANKS_MARK, STEP_FIELDS, STEP_PREFIX, split_step, step_object

WORLD = 3
KEYS = ("loss", "mem/device/headroom_gib", "mem/host/rss_gib", "mem/phase/update/peak_rss_gib")


def _metrics(ranks: dict[str, list[float | None]], min_rank: bool) -> dict[str, float]:
    """The aggregates as the monitor names them, NaN where no rank has a value."""
    out: dict[str, float] = {}
    for key, vec in ranks.items():
        values = np.array([math.nan if v is None else v for v in vec])
        ok = ~np.isnan(values)
        out[f"{key}/max"] = float(values[ok].max()) if ok.any() else math.nan
        out[f"{key}/min"] = float(values[ok].min()) if ok.any() else math.nan
        out[f"{key}/mean"] = float(values[ok].mean()) if ok.any() else math.nan
        out[f"{key}/max_rank"] = float(np.where(ok, values, -np.inf).argmax()) if ok.any() else -1.0
        if min_rank:
            out[f"{key}/min_rank"] = float(np.where(ok, values, np.inf).argmin()) if ok.any() else -1.0
    out["perf/cpu_memory_used_gb"] = out.get("mem/host/rss_gib/max", math.nan)
    return out


def _records(n: int, min_rank: bool) -> list[StepRecord]:
    """Steps with everything a real log holds: full-precision floats, ints, a NaN (written as null), a
    rank without a phase key, a key set that changes mid-run, and keys that only some steps have."""
    rng = np.random.default_rng(3)
    out = []
    for i in range(n):
        ranks: dict[str, list[float | None]] = {}
        for key in KEYS:
            ranks[key] = [float(v) for v in rng.uniform(0.5, 40.0, WORLD)]
        ranks["loss"][1] = math.nan if i % 5 == 0 else 2  # a diverged loss; an int
        ranks["mem/phase/update/peak_rss_gib"][2] = None  # rank 2 skipped the phase
        if i >= n // 2:
            ranks["mem/phase/rollout/peak_rss_gib"] = [1.0, 2.0, 3.0]  # a phase that starts mid-run
        if i % 3 == 0:
            del ranks["mem/device/headroom_gib"]  # a key some steps lack
        out.append(StepRecord(step=10 * i, time=1.7e9 + i / 3, metrics=_metrics(ranks, min_rank), ranks=ranks))
    return out


def _write(path: Path, records: list[StepRecord], detail: str = "inline") -> None:
    ranks = [RankInfo(rank=r, local_rank=r, host="node0", pid=100 + r, device="none", peak_rss_scope="window")
             for r in range(WORLD)]
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = RunLogWriter(str(path), detail=detail)
    writer.open(RunHeader(world_size=WORLD, ranks=ranks, config={"lr": 0.5}, started=1.7e9))
    for record in records:
        writer.write(record)
    writer.close()


@pytest.mark.parametrize("min_rank", [True, False], ids=["with-min_rank", "before-min_rank"])
def test_writer_lines_take_the_fast_path_and_agree_with_the_slow_path(tmp_path: Path, min_rank: bool) -> None:
    records = _records(40, min_rank)
    _write(tmp_path / RUN_LOG_NAME, records)
    fast = read_run(str(tmp_path))
    slow = read_run(str(tmp_path), metrics=True)  # every line through a full json.loads
    assert (fast.slow_lines, slow.slow_lines) == (0, len(records))
    assert fast.corrupt == slow.corrupt == 0 and not fast.truncated and not slow.truncated
    assert fast.header == slow.header and fast.world_size == WORLD
    np.testing.assert_array_equal(fast.steps, slow.steps)
    np.testing.assert_array_equal(fast.times, slow.times)
    assert fast.steps.dtype == slow.steps.dtype and fast.times.dtype == slow.times.dtype
    assert sorted(fast.series) == sorted(slow.series) == sorted([*KEYS, "mem/phase/rollout/peak_rss_gib"])
    for key, matrix in fast.series.items():
        np.testing.assert_array_equal(matrix, slow.series[key], err_msg=key)  # NaN equals NaN here
    # And both hold what was written.
    for row, record in enumerate(records):
        assert fast.steps[row] == record.step and fast.times[row] == record.time
        for key, vec in record.ranks.items():
            want = [math.nan if v is None else float(v) for v in vec]
            np.testing.assert_array_equal(fast.series[key][row], want, err_msg=f"{key} step {record.step}")
    assert slow.metrics is not None
    assert sorted(slow.metrics) == sorted({k for r in records for k in r.metrics})
    assert any(k.endswith("/min_rank") for k in slow.metrics) == min_rank
    for row, record in enumerate(records):
        for key, value in record.metrics.items():
            np.testing.assert_array_equal(slow.metrics[key][row], value, err_msg=key)


def test_every_step_line_is_in_the_layout(tmp_path: Path) -> None:
    records = _records(6, min_rank=True)
    _write(tmp_path / RUN_LOG_NAME, records)
    lines = (tmp_path / RUN_LOG_NAME).read_text().splitlines(keepends=True)
    assert json.loads(lines[0])["kind"] == "header"
    for line, record in zip(lines[1:], records, strict=True):
        obj = json.loads(line)
        assert tuple(obj) == STEP_FIELDS and line.startswith(STEP_PREFIX) and RANKS_MARK in line
        split = split_step(line)
        assert split is not None
        assert split[:2] == (record.step, record.time)
        assert json.loads(split[2]) == obj["ranks"]
    assert tuple(step_object(1, 2.0, {}, {})) == STEP_FIELDS


@pytest.mark.parametrize(
    "line",
    [
        '{"kind": "step", "step": 1, "time": 2.0, "metrics": {}, "ranks": {"a": [1]}}\n',  # spaces
        '{"step":1,"kind":"step","time":2.0,"metrics":{},"ranks":{"a":[1]}}\n',  # another field order
        '{"kind":"step","step":1,"metrics":{},"time":2.0,"ranks":{"a":[1]}}\n',
        '{"kind":"step","step":1,"time":2.0,"ranks":{"a":[1]},"metrics":{}}\n',  # ranks not last
        '{"kind":"step","step":1,"time":2.0,"metrics":{},"ranks":{"a":[1]},"x":0}\n',
    ],
)
def test_other_layouts_take_the_slow_path(tmp_path: Path, line: str) -> None:
    (tmp_path / RUN_LOG_NAME).write_text('{"kind":"header","schema":1,"world_size":1}\n' + line)
    run = read_run(str(tmp_path))
    assert run.slow_lines == 1 and run.corrupt == 0
    assert run.steps.tolist() == [1] and run.times.tolist() == [2.0] and run.series["a"].tolist() == [[1.0]]


def test_split_step_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    good = '{"kind":"step","step":1,"time":2.0,"metrics":{"a/max":1},"ranks":{"a":[1]}}\n'
    assert split_step(good) == (1, 2.0, '{"a":[1]}')
    assert split_step(good.replace("2.0", "null")) is None  # a time that was not finite: the slow path reads nan
    assert split_step(good.replace('"step":1', '"step":1.5')) is None
    assert split_step(good.rstrip("\n")) is None  # truncated, or a last line without a newline
    assert split_step(good.replace('"ranks"', '"per_rank"')) is None
    (tmp_path / RUN_LOG_NAME).write_text('{"kind":"header","schema":1,"world_size":1}\n' + good.replace("2.0", "null"))
    run = read_run(str(tmp_path))
    assert run.slow_lines == 1 and math.isnan(run.times[0]) and run.series["a"].tolist() == [[1.0]]


@pytest.mark.parametrize("min_rank", [True, False], ids=["with-min_rank", "before-min_rank"])
def test_the_columnar_side_file_reads_as_the_inline_lines(tmp_path: Path, min_rank: bool) -> None:
    """The same records written both ways give the same arrays: steps, times, every per-rank value (a
    NaN, an int, a key set that changes mid-run, keys some steps lack) and the aggregates."""
    records = _records(40, min_rank)
    _write(tmp_path / "inline" / RUN_LOG_NAME, records)
    _write(tmp_path / "columnar" / RUN_LOG_NAME, records, detail="columnar")
    assert (tmp_path / "columnar" / DETAIL_NAME).stat().st_size > 0 and not (tmp_path / "inline" / DETAIL_NAME).exists()
    lines = (tmp_path / "columnar" / RUN_LOG_NAME).read_text().splitlines()
    assert json.loads(lines[0])["detail"] == DETAIL_NAME and json.loads(lines[0])["schema"] == 2
    assert all(tuple(json.loads(line)) == STEP_FIELDS[:-1] for line in lines[1:])  # no per-rank values
    inline, columnar = read_run(str(tmp_path / "inline"), metrics=True), read_run(str(tmp_path / "columnar"), metrics=True)
    assert columnar.logged is None and columnar.slow_lines == 0 and columnar.corrupt == 0 and not columnar.truncated
    np.testing.assert_array_equal(columnar.steps, inline.steps)
    np.testing.assert_array_equal(columnar.times, inline.times)
    assert sorted(columnar.series) == sorted(inline.series)
    for key, matrix in inline.series.items():
        np.testing.assert_array_equal(columnar.series[key], matrix, err_msg=key)
    assert inline.metrics is not None and columnar.metrics is not None
    for key, values in inline.metrics.items():
        if key.startswith("perf/"):
            assert key not in columnar.metrics  # verl's names are on the lines only
            continue
        np.testing.assert_array_equal(columnar.metrics[key], values, err_msg=key)
