"""Run-log reader faults (issue 12 of issue 11's list): whatever a log holds, the reader either reads
it (counting the lines it cannot use, with their numbers) or refuses it in one line, exit 2 in the
CLI; it never raises a traceback, never files a value under another step or rank, never allocates by a
header's say-so. A read with ``metrics=True`` always agrees with one without."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rankmem
from rankmem.cli import main
from rankmem.offline import Run, read_run
from rankmem.runlog import RUN_LOG_NAME

HEADER = {"kind": "header", "schema": 3, "world_size": 2, "detail": "rankmem.ranks.f64"}


def _step_line(step: int, value: float) -> str:
    return json.dumps({"kind": "step", "step": step, "time": 1.7e9 + step, "metrics": {"a/max": value}},
                      separators=(",", ":")) + "\n"


def _write(tmp_path: Path, lines: list[str], header: dict[str, Any] | str = HEADER) -> Path:
    path = tmp_path / RUN_LOG_NAME
    first = header if isinstance(header, str) else json.dumps(header) + "\n"
    path.write_text(first + "".join(lines))
    return path


def _both(path: Path) -> Run:
    """Read ``path`` with and without the aggregates; they must agree on every step, value and line."""
    fast, slow = read_run(str(path)), read_run(str(path), metrics=True)
    assert fast.steps.tolist() == slow.steps.tolist()
    assert fast.corrupt_lines == slow.corrupt_lines and fast.truncated == slow.truncated
    np.testing.assert_array_equal(fast.times, slow.times)
    assert sorted(fast.series) == sorted(slow.series)
    for key, matrix in fast.series.items():
        np.testing.assert_array_equal(matrix, slow.series[key], err_msg=key)
    return fast


def _values(n: int) -> list[str]:
    return [_step_line(s, float(s)) for s in range(n)]


HEADERS = [
    ({**HEADER, "world_size": 0}, "the header's world_size must be the number of ranks (an integer >= 1), got 0"),
    ({"kind": "header", "schema": 3},
     "the header's world_size must be the number of ranks (an integer >= 1), got None"),
    ({**HEADER, "world_size": -1}, "the header's world_size must be the number of ranks (an integer >= 1), got -1"),
    ({**HEADER, "world_size": "two"},
     "the header's world_size must be the number of ranks (an integer >= 1), got 'two'"),
    ({**HEADER, "world_size": True}, "the header's world_size must be the number of ranks (an integer >= 1), got True"),
    ({**HEADER, "world_size": 10**9}, "the header's world_size 1000000000 is more than 1048576 ranks"),
    ({**HEADER, "world_size": 10**9, "ranks": [{"rank": 0}, {"rank": 1}]},
     "the header's world_size is 1000000000 but it lists 2 ranks"),
    ({**HEADER, "world_size": int("9" * 400)},
     "the header's world_size 999999999999999999999999999999... (400 characters) "
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
    path = _write(tmp_path, _values(3), '{"kind":"header","schema":3,"x":' + "[" * 100_000 + "]" * 100_000 + "}\n")
    assert main(["report", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"rankmem report: error: {path} has no header line: its first line must be a "
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
