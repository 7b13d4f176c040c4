"""The run log reader: arrays per key, corrupt and truncated lines counted, clear errors for bad files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import rankmem
from rankmem.errors import RankmemError
from rankmem.offline import read_run
from rankmem.runlog import RUN_LOG_NAME
from tests.runlog_helpers import write_run

RSS = "mem/host/rss_gib"


def _two_rank(tmp_path: Path, n: int = 6, detail: str = "inline") -> Path:
    """A log with its per-rank values on the lines: what these tests damage line by line."""
    rss = np.column_stack([np.arange(n) * 0.5, np.arange(n) * 0.25 + 1.0])
    phase = np.full((n, 2), np.nan)
    phase[::2, 1] = 7.0  # only rank 1, only on even steps
    return write_run(tmp_path, {RSS: rss, "mem/phase/update/peak_rss_gib": phase}, steps=np.arange(n) * 10,
                     detail=detail)


@pytest.mark.parametrize("detail", ["inline", "columnar"])
def test_reads_values_steps_and_missing_as_nan(tmp_path: Path, detail: str) -> None:
    _two_rank(tmp_path, detail=detail)
    run = read_run(str(tmp_path))  # a run directory works as well as the file
    assert run.world_size == 2
    assert run.steps.tolist() == [0, 10, 20, 30, 40, 50]
    assert run.series[RSS][:, 0].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert run.series[RSS][:, 1].tolist() == [1.0, 1.25, 1.5, 1.75, 2.0, 2.25]
    phase = run.series["mem/phase/update/peak_rss_gib"]
    assert np.isnan(phase[:, 0]).all()
    assert phase[::2, 1].tolist() == [7.0, 7.0, 7.0]
    assert np.isnan(phase[1::2, 1]).all()
    assert run.phases() == ["update"]
    assert run.corrupt == 0 and not run.truncated and run.metrics is None


@pytest.mark.parametrize("detail", ["inline", "columnar"])
def test_metrics_option_matches_fast_path(tmp_path: Path, detail: str) -> None:
    path = _two_rank(tmp_path, detail=detail)
    full = read_run(str(path), metrics=True)
    fast = read_run(str(path))
    assert full.metrics is not None
    assert full.metrics[RSS + "/max"].tolist() == [1.0, 1.25, 1.5, 1.75, 2.0, 2.5]
    assert full.metrics[RSS + "/max_rank"].tolist() == [1, 1, 1, 1, 0, 0]  # the tie at step 40 goes to rank 0
    np.testing.assert_array_equal(full.series[RSS], fast.series[RSS])


def test_corrupt_lines_counted_and_truncated_last_line_skipped(tmp_path: Path) -> None:
    path = _two_rank(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    lines.insert(3, "this is not json\n")
    lines.insert(5, '{"kind":"step","step":99,"time":1.0,"metrics":{},"ranks":{"x":[1,\n')
    lines.append(lines[-1][: len(lines[-1]) // 2])  # a crash mid-write: no newline
    path.write_text("".join(lines))
    run = read_run(str(path))
    assert run.corrupt_lines == [4, 6]
    assert run.truncated
    assert run.steps.tolist() == [0, 10, 20, 30, 40, 50]


def test_other_writers_layout_takes_the_slow_path(tmp_path: Path) -> None:
    header = {"kind": "header", "schema": 1, "world_size": 2}
    step = {"ranks": {RSS: [1.5, None]}, "time": 3.0, "step": 7, "kind": "step"}
    (tmp_path / RUN_LOG_NAME).write_text(json.dumps(header) + "\n" + json.dumps(step, indent=None) + "\n")
    run = read_run(str(tmp_path / RUN_LOG_NAME))
    assert run.steps.tolist() == [7] and run.times.tolist() == [3.0]
    assert run.series[RSS][0, 0] == 1.5 and math.isnan(run.series[RSS][0, 1])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "is empty: the run wrote no header"),
        ('{"kind":"step","step":0}\n', "has no header line"),
        ("garbage\n", "has no header line"),
        ('{"kind":"header","schema":7,"world_size":1}\n', "has run log schema 7; this rankmem reads schema 1"),
    ],
)
def test_bad_files_raise_clear_errors(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / RUN_LOG_NAME
    path.write_text(content)
    with pytest.raises(RankmemError, match=message):
        read_run(str(path))


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(RankmemError, match=f"no run log in {tmp_path}: expected .*{RUN_LOG_NAME}"):
        read_run(str(tmp_path))
    with pytest.raises(RankmemError, match="no run log at .*nope.jsonl: pass a run directory"):
        read_run(str(tmp_path / "nope.jsonl"))


def test_real_monitor_run_reads_back(tmp_path: Path) -> None:
    monitor = rankmem.Monitor(out_dir=str(tmp_path), sinks=("jsonl",), device="cpu", children=False)
    for step in range(4):
        with monitor.step(step):
            with monitor.phase("update"):
                pass
        monitor.collect({"loss": 1.0 / (step + 1)})
    monitor.close()
    run = read_run(str(tmp_path))
    assert run.steps.tolist() == [0, 1, 2, 3]
    assert run.world_size == 1 and run.header.schema == 2 and run.header.detail == "rankmem.ranks.arrow"
    assert run.series["loss"][:, 0].tolist() == [1.0, 0.5, 1.0 / 3, 0.25]
    assert (run.series[RSS] > 0.001).all()
    assert run.phases() == ["update"]


def test_chunked_arrays_match(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import rankmem.offline.runlog as runlog

    _two_rank(tmp_path, n=9)
    whole = read_run(str(tmp_path))
    monkeypatch.setattr(runlog, "_CHUNK", 2)  # flush to numpy blocks every 2 rows
    chunked = read_run(str(tmp_path))
    for key, matrix in whole.series.items():
        np.testing.assert_array_equal(chunked.series[key], matrix)
    assert chunked.series[RSS][8].tolist() == [4.0, 3.0]


def _write_steps(tmp_path: Path, ranks_per_step: list[dict[str, object]], world: int = 2) -> Path:
    """A run log in the writer's layout with hand-written per-rank objects (keys may differ by step)."""
    header = {"kind": "header", "schema": 1, "world_size": world}
    lines = [json.dumps(header)]
    for step, ranks in enumerate(ranks_per_step):
        obj = {"kind": "step", "step": step, "time": 1.0 + step, "metrics": {}, "ranks": ranks}
        lines.append(json.dumps(obj, separators=(",", ":")))
    path = tmp_path / RUN_LOG_NAME
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("chunk", [1024, 2, 1])
def test_keys_that_differ_by_step_nulls_and_odd_vectors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    import rankmem.offline.runlog as runlog

    monkeypatch.setattr(runlog, "_CHUNK", chunk)
    path = _write_steps(
        tmp_path,
        [
            {"a": [1.0, 2.0], "b": [3, None]},
            {"a": [4.0, 5.0]},  # b absent
            {"b": [6.0, 7.0], "a": [8.0, 9.0]},  # other key order
            {"a": [10.0], "b": [11.0, 12.0, 13.0]},  # ragged: whose rank is 10.0? the line is corrupt
            {"a": None, "b": [True, 1.0]},  # not a vector: corrupt
            {"a": [None, None], "b": ["x", True], "c": [16.0, 17.0]},  # not numbers: nan; c only here
        ],
    )
    run = read_run(str(path))
    nan = math.nan
    np.testing.assert_array_equal(run.series["a"], [[1, 2], [4, 5], [8, 9], [nan, nan]])
    np.testing.assert_array_equal(run.series["b"], [[3, nan], [nan, nan], [6, 7], [nan, 1]])
    np.testing.assert_array_equal(run.series["c"], [[nan, nan]] * 3 + [[16, 17]])
    assert run.steps.tolist() == [0, 1, 2, 5] and run.corrupt_lines == [5, 6]
    full = read_run(str(path), metrics=True)  # the slow path agrees
    assert full.steps.tolist() == run.steps.tolist() and full.corrupt_lines == run.corrupt_lines
    for key, matrix in run.series.items():
        np.testing.assert_array_equal(full.series[key], matrix)


def test_blank_lines_skipped_and_a_whole_last_line_without_newline_kept(tmp_path: Path) -> None:
    path = _write_steps(tmp_path, [{"a": [1.0, 2.0]}, {"a": [3.0, 4.0]}])
    text = path.read_text().rstrip("\n")
    lines = text.split("\n")
    path.write_text(lines[0] + "\n\n" + lines[1] + "\n" + lines[2])  # no newline after the last line
    run = read_run(str(path))
    assert run.series["a"].tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert run.corrupt == 0 and not run.truncated



def test_a_string_per_rank_value_is_nan_whatever_the_other_rows_hold(tmp_path: Path) -> None:
    """_Columns._blocks_of tries np.fromiter(dtype=float) first, which parses the string "7.5" as 7.5;
    only when something else in the same 256-row chunk fails (a null) does it fall back to
    to_float_or_nan, which makes the same string NaN. So one string value reads as 7.5 GiB or as
    absent depending on its neighbours (the docstring says strings are NaN, as on the slow path)."""
    from rankmem.offline import read_run

    head = '{"kind":"header","schema":1,"world_size":2}\n'
    line = '{"kind":"step","step":0,"time":1.0,"metrics":{},"ranks":{"mem/host/rss_gib":["7.5",1.0]}}\n'
    other = '{"kind":"step","step":1,"time":2.0,"metrics":{},"ranks":{"mem/host/rss_gib":[null,1.0]}}\n'
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "rankmem.jsonl").write_text(head + line)
    (tmp_path / "b" / "rankmem.jsonl").write_text(head + line + other)
    alone = read_run(str(tmp_path / "a")).series["mem/host/rss_gib"][0, 0]
    with_null = read_run(str(tmp_path / "b")).series["mem/host/rss_gib"][0, 0]
    assert math.isnan(with_null)
    assert math.isnan(alone), alone  # 7.5 today
