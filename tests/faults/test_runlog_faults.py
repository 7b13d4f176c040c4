"""Run-log reader faults (issue 12 of issue 11's list): whatever a log holds, the reader either reads
it (counting the lines it cannot use, with their numbers) or refuses it in one line, exit 2 in the
CLI; it never raises a traceback, never files a value under another step or rank, never allocates by a
header's say-so. The fast path and the slow path (``metrics=True``) always agree."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rankmem
from rankmem.cli import main
from rankmem.offline import Run, read_run
from rankmem.runlog import RUN_LOG_NAME

HEADER = {"kind": "header", "schema": 1, "world_size": 2}


def _step_line(step: int, a: list[Any], time: float | None = None) -> str:
    obj = {"kind": "step", "step": step, "time": 1.7e9 + step if time is None else time,
           "metrics": {"a/max": max(a) if a and all(isinstance(v, float) for v in a) else None}, "ranks": {"a": a}}
    return json.dumps(obj, separators=(",", ":")) + "\n"


def _write(tmp_path: Path, lines: list[str], header: dict[str, Any] | str = HEADER) -> Path:
    path = tmp_path / RUN_LOG_NAME
    first = header if isinstance(header, str) else json.dumps(header) + "\n"
    path.write_text(first + "".join(lines))
    return path


def _both(path: Path) -> Run:
    """Read ``path`` by both paths; they must agree on every step, value and corrupt line."""
    fast, slow = read_run(str(path)), read_run(str(path), metrics=True)
    assert fast.steps.tolist() == slow.steps.tolist()
    assert fast.corrupt_lines == slow.corrupt_lines and fast.truncated == slow.truncated
    np.testing.assert_array_equal(fast.times, slow.times)
    assert sorted(fast.series) == sorted(slow.series)
    for key, matrix in fast.series.items():
        np.testing.assert_array_equal(matrix, slow.series[key], err_msg=key)
    return fast


def _values(n: int) -> list[str]:
    return [_step_line(s, [float(s), float(s) + 0.5]) for s in range(n)]


@pytest.mark.parametrize("cut", [30, 60, 90, -20, -3, -2])
def test_a_torn_line_then_a_whole_one_files_nothing_under_the_wrong_step(tmp_path: Path, cut: int) -> None:
    lines = _values(60)
    lines[50] = lines[50][:cut].rstrip("\n")  # a crash mid-write, then the next line appended after it
    path = _write(tmp_path, lines)
    run = _both(path)
    assert run.corrupt_lines == [52]  # the header is line 1: step 50's torn line is line 52
    assert run.steps.tolist() == [*range(50), *range(51, 60)]
    row = run.steps.tolist().index(51)
    assert run.series["a"][row].tolist() == [51.0, 51.5]  # step 51's values, under step 51


def test_vectors_of_the_wrong_length_are_corrupt_lines_never_cut_or_padded(tmp_path: Path) -> None:
    lines = _values(6)
    lines[2] = _step_line(2, [2.0])  # one rank short: which rank is this?
    lines[4] = _step_line(4, [4.0, 4.5, 900.0])  # a third value in a 2-rank run
    run = _both(_write(tmp_path, lines))
    assert run.corrupt_lines == [4, 6] and run.steps.tolist() == [0, 1, 3, 5]
    assert run.series["a"].tolist() == [[0.0, 0.5], [1.0, 1.5], [3.0, 3.5], [5.0, 5.5]]


def test_numbers_and_nesting_past_any_limit_are_corrupt_lines_or_nan(tmp_path: Path) -> None:
    big = "9" * 400
    lines = _values(8)
    lines[1] = lines[1].replace('"step":1,', f'"step":{big},')  # a step no int64 holds
    lines[2] = lines[2].replace('"step":2,', f'"step":{2**70},')
    lines[3] = lines[3].replace('"a":[3.0,3.5]', '"a":[' + "[" * 100_000 + "]" * 100_000 + ",3.5]")
    lines[4] = lines[4].replace('"a":[4.0,4.5]', f'"a":[{big},4.5]')  # a value past float64: nan, like a string
    lines[5] = lines[5].replace(f'"time":{1.7e9 + 5}', f'"time":{big}')  # a time past float64: nan
    lines[6] = lines[6].replace('"step":6,', '"step":true,')
    run = _both(_write(tmp_path, lines))
    assert run.corrupt_lines == [3, 4, 5, 8]
    assert run.steps.tolist() == [0, 4, 5, 7]
    assert math.isnan(run.series["a"][1, 0]) and run.series["a"][1, 1] == 4.5
    assert math.isnan(run.times[2]) and run.series["a"][2].tolist() == [5.0, 5.5]


def test_number_forms_json_refuses_are_refused_by_the_fast_path_too(tmp_path: Path) -> None:
    lines = _values(5)
    lines[1] = lines[1].replace('"step":1,', '"step":1_1,')  # int() reads 11; json.loads refuses
    lines[2] = lines[2].replace('"step":2,', '"step":02,')
    lines[3] = lines[3].replace(f'"time":{1.7e9 + 3}', '"time":nan')
    run = _both(_write(tmp_path, lines))
    assert run.corrupt_lines == [3, 4, 5] and run.steps.tolist() == [0, 4]


HEADERS = [
    ({**HEADER, "world_size": 0}, "the header's world_size must be the number of ranks (an integer >= 1), got 0"),
    ({"kind": "header", "schema": 1}, "the header's world_size must be the number of ranks (an integer >= 1), got None"),
    ({**HEADER, "world_size": -1}, "the header's world_size must be the number of ranks (an integer >= 1), got -1"),
    ({**HEADER, "world_size": "two"}, "the header's world_size must be the number of ranks (an integer >= 1), got 'two'"),
    ({**HEADER, "world_size": True}, "the header's world_size must be the number of ranks (an integer >= 1), got True"),
    ({**HEADER, "world_size": 10**9}, "the header's world_size 1000000000 is more than 1048576 ranks"),
    ({**HEADER, "world_size": 10**9, "ranks": [{"rank": 0}, {"rank": 1}]},
     "the header's world_size is 1000000000 but it lists 2 ranks"),
    ({**HEADER, "world_size": int("9" * 400)}, "the header's world_size 999999999999999999999999999999... (400 characters) "
                                               "is more than 1048576 ranks"),
    ({**HEADER, "ranks": None}, "the header's 'ranks' must be a list of per-rank records, got None"),
]


@pytest.mark.parametrize(("header", "message"), HEADERS, ids=[m[:40] for _, m in HEADERS])
@pytest.mark.parametrize("command", ["report", "leaks", "plot"])
def test_a_damaged_header_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  header: dict[str, Any], message: str, command: str) -> None:
    path = _write(tmp_path, _values(3), header)
    extra = ["-o", str(tmp_path / "x.png")] if command == "plot" else []
    assert main([command, str(path), *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"rankmem {command}: error: {path}: {message}")


def test_a_header_nested_past_the_parser_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, _values(3), '{"kind":"header","schema":1,"x":' + "[" * 100_000 + "]" * 100_000 + "}\n")
    assert main(["report", str(path)]) == 2
    assert capsys.readouterr().err == (f"rankmem report: error: {path} has no header line: its first line must be a "
                                       'rankmem run log header ({"kind":"header",...}); is this a rankmem.jsonl file?\n')


def test_collect_with_a_step_past_int64_leaves_a_log_the_reader_opens(tmp_path: Path) -> None:
    monitor = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", children=False, leak_check=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (0, 2**70, 2):
            monitor.collect({"loss": 1.0}, step=step)
        monitor.close()
    run = _both(tmp_path / RUN_LOG_NAME)
    assert run.steps.tolist() == [0, 2] and run.corrupt == 0
    assert any(f"step {2**70} is outside the run log's 64-bit step range; that record is not written" in str(w.message)
               for w in caught)
