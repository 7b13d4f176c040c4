"""The ``rankmem`` command end to end: exit codes and exact output lines shared by report, plot and leaks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rankmem.cli import main
from rankmem.runlog import RUN_LOG_NAME
from tests.conftest import REPO
from tests.runlog_helpers import KNOWN_LEAK_LINE, KNOWN_WORLD, known_run, write_run


def test_report_counts_corrupt_and_truncated_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = known_run(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    # Lines past the side file's last collect are read from the log: two damaged, one cut mid-write.
    path.write_text("".join(lines) + "{not json\n" + "\x00\x00\x00\n" + lines[-1][:40])
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    at = out.index(f"run log: {path}")
    assert out[at + 1:at + 3] == ["4 ranks on 1 host, 40 logged steps (steps 0..39)",
                                  "skipped: 2 corrupt lines, a truncated last line"]
    assert main(["leaks", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "skipped: 2 corrupt line(s), a truncated last line",
        "no leak found (4 rank series checked)",
    ]


@pytest.mark.parametrize("command", ["report", "leaks", "plot"])
def test_bad_logs_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    path = tmp_path / RUN_LOG_NAME
    extra = ["-o", str(tmp_path / "x.png")] if command == "plot" else []
    path.write_text('{"kind":"header","schema":7,"world_size":2}\n')
    assert main([command, str(path), *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"rankmem {command}: error: {path} has run log schema 7; this rankmem reads schema 3: "
        "read it with the rankmem version that wrote it (see the header's 'rankmem' field)"
    ]
    path.write_text("")
    assert main([command, str(path), *extra]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"rankmem {command}: error: {path} is empty: the run wrote no header (a run log starts at the first collect())"
    ]
    assert main([command, str(tmp_path / "missing"), *extra]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"rankmem {command}: error: no run log at {tmp_path / 'missing'}: pass a run directory holding rankmem.jsonl, "
        "or the .jsonl file"
    ]


def test_python_dash_m_rankmem_report_subprocess(tmp_path: Path) -> None:
    known_run(tmp_path, leak_rank=0)
    done = subprocess.run([sys.executable, "-m", "rankmem", "report", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(KNOWN_LEAK_LINE.format(rank=0), done.stdout.splitlines()[0])  # no events: leaks first
    done = subprocess.run([sys.executable, "-m", "rankmem", "leaks", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("rankmem leaks: error: no run log at ") and "Traceback" not in done.stderr


NO_STEPS = {
    "report": "has no logged steps: the run stopped, or its jsonl sink failed, before its first collect() was "
              "written; see the job's output for why, and run rankmem report on a run log that has steps",
    "leaks": "has no logged steps: the run stopped, or its jsonl sink failed, before its first collect() was "
             "written; see the job's output for why, and run rankmem leaks on a run log that has steps",
    "plot": "has no logged steps to plot: the run stopped, or its jsonl sink failed, before its first collect() was "
            "written; see the job's output for why, and plot a run log that has steps",
}


@pytest.mark.parametrize("command", ["report", "leaks", "plot"])
def test_header_only_log_says_it_has_no_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    if command == "plot":
        pytest.importorskip("matplotlib")  # without it, plot names the missing extra first
    path = write_run(tmp_path, {"mem/host/rss_gib": np.zeros((0, KNOWN_WORLD))})  # the header line only
    flags = [["-o", str(tmp_path / "x.png")]] if command == "plot" else [[], ["--json"]]
    for extra in flags:
        assert main([command, str(tmp_path), *extra]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.splitlines() == [f"rankmem {command}: error: {path} {NO_STEPS[command]}"]
    assert not (tmp_path / "x.png").exists()
