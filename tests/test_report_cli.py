"""``rankmem report``, ``plot`` and ``leaks`` end to end: exit codes and exact output lines."""

from __future__ import annotations

import importlib.util
import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rankmem.cli import main
from rankmem.runlog import RUN_LOG_NAME
from tests.conftest import REPO
from tests.runlog_helpers import write_run

N, WORLD = 40, 4
MIB = 1 / 1024
# 8 MiB/step under 4 MiB noise, judged on the last 20 steps: the slope lands within ~0.5 of 8.
LEAK_LINE = (
    r"LEAK rank {rank} mem/host/rss_gib: \+(7\.[5-9]|8\.[0-4])\d\d MiB/step \(95% CI \+\d\.\d+\.\.\+\d\.\d+, "
    r"p=\d\.\de-\d+\), \+1[45]\d\.\d MiB over steps 20\.\.39"
)


def _run_with_known_values(out: Path, leak_rank: int | None = None) -> Path:
    """4 ranks, 40 steps. Rank 2 holds the most (its update phase peaks at 4.5 GiB on step 7); rank 1 has
    the least device headroom (0.25 GiB on step 3)."""
    rng = np.random.default_rng(7)
    rss = np.array([1.0, 1.0, 3.0, 1.0]) + rng.normal(0, 4, (N, WORLD)) * MIB
    if leak_rank is not None:
        rss[:, leak_rank] += np.arange(N) * 8 * MIB  # 8 MiB/step
    rollout = rss + 0.5
    update = rss + 0.25
    update[7, 2] = 4.5
    peak = np.maximum(rollout, update)
    headroom = np.full((N, WORLD), 10.0)
    headroom[3, 1] = 0.25
    return write_run(out, {
        "mem/host/rss_gib": rss,
        "mem/host/peak_rss_gib": peak,
        "mem/phase/rollout/peak_rss_gib": rollout,
        "mem/phase/update/peak_rss_gib": update,
        "mem/device/headroom_gib": headroom,
    })


def test_report_names_the_rank_step_and_phase(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _run_with_known_values(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [f"run log: {path}", "4 ranks on 1 host, 40 logged steps (steps 0..39)"]
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.strip().startswith("mem/")}
    assert rows["mem/host/peak_rss_gib"][:6] == ["max", "4.500", "GiB", "7", "2", "update"]
    assert rows["mem/device/headroom_gib"] == ["min", "0.250", "GiB", "3", "1"]
    worst, value, unit, _, rank, imbalance = rows["mem/host/rss_gib"]  # no phase: RSS is a current value
    assert (worst, unit, rank) == ("max", "GiB", "2") and 3.0 < float(value) < 3.02
    assert float(imbalance) == pytest.approx(3.0 / 1.5, abs=0.02)  # max / mean of the per-rank peaks
    assert "device headroom: min 0.250 GiB at step 3 on rank 1" in lines
    assert lines[-1] == "leaks: none found (4 rank series checked)"  # RSS only: no device, no workers


def test_report_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run_with_known_values(tmp_path)
    assert main(["report", str(tmp_path / RUN_LOG_NAME), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = {k["key"]: k for k in out["keys"]}
    peak = keys["mem/host/peak_rss_gib"]
    assert (peak["value"], peak["step"], peak["rank"], peak["phase"]) == (4.5, 7, 2, "update")
    rollout_peaks = [keys["mem/host/peak_rss_gib"]["imbalance"]]
    assert rollout_peaks[0] == pytest.approx(4.5 / ((1.5 * 3 + 4.5) / 4), rel=0.01)  # max / mean of per-rank peaks
    assert keys["mem/device/headroom_gib"]["imbalance"] is None
    assert out["headroom"]["rank"] == 1 and out["leaks"] == [] and out["world_size"] == 4
    assert out["corrupt"] == 0 and out["truncated"] is False


def test_report_counts_corrupt_and_truncated_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _run_with_known_values(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    lines[5] = "{not json\n"
    lines[9] = "\x00\x00\x00\n"
    path.write_text("".join(lines) + lines[-1][:40])
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:3] == ["4 ranks on 1 host, 38 logged steps (steps 0..39)", "skipped: 2 corrupt lines, a truncated last line"]
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
        f"rankmem {command}: error: {path} has run log schema 7; this rankmem reads schema 1: "
        "read it with the rankmem version that wrote it (see the header's 'rankmem' field)"
    ]
    path.write_text("")
    assert main([command, str(path), *extra]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"rankmem {command}: error: {path} is empty: the run wrote no header (a run log starts at the first collect())"
    ]
    assert main([command, str(tmp_path / "missing"), *extra]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"rankmem {command}: error: no run log at {tmp_path / 'missing'}: pass a run directory holding rankmem.jsonl, or the .jsonl file"
    ]


def test_leaks_flags_the_leaking_rank_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run_with_known_values(tmp_path, leak_rank=3)
    assert main(["leaks", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert re.fullmatch(LEAK_LINE.format(rank=3), lines[0]), lines[0]
    assert lines[1] == "leak found on rank 3"
    assert main(["leaks", str(tmp_path), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert [(t["key"], t["rank"]) for t in out["leaks"]] == [("mem/host/rss_gib", 3)]
    assert out["leaks"][0]["slope_mib"] == pytest.approx(8.0, abs=0.5)
    assert main(["leaks", str(tmp_path), "--last", "2"]) == 2
    assert capsys.readouterr().err == "rankmem leaks: error: leak window 'last' must be at least 3 steps, got 2\n"


def test_leaks_clean_run_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run_with_known_values(tmp_path)
    assert main(["leaks", str(tmp_path), "-v"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:4]] == [f"ok   rank {r} mem/host/rss_gib" for r in range(4)]
    assert lines[-1] == "no leak found (4 rank series checked)"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def test_plot_writes_png_of_the_asked_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run_with_known_values(tmp_path)
    out = tmp_path / "mem.png"
    assert main(["plot", str(tmp_path), "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out} (mem/host/rss_gib, mem/host/peak_rss_gib)\n"
    assert _png_size(out) == (1200, 720)  # 360 px per default key present
    assert main(["plot", str(tmp_path), "-o", str(out), "--keys", "mem/device/headroom_gib", "--size", "800x500"]) == 0
    assert _png_size(out) == (800, 500)
    capsys.readouterr()
    assert main(["plot", str(tmp_path), "-o", str(out), "--keys", "mem/nope"]) == 2
    assert capsys.readouterr().err == (
        "rankmem plot: error: no such key(s) in the run log: mem/nope; choose from: "
        "mem/device/headroom_gib, mem/host/peak_rss_gib, mem/host/rss_gib\n"
    )


def test_plot_without_matplotlib_names_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _run_with_known_values(tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err == (
        "rankmem plot: error: rankmem plot needs matplotlib, which is not installed: pip install 'rankmem[plot]'\n"
    )


def test_python_dash_m_rankmem_report_subprocess(tmp_path: Path) -> None:
    _run_with_known_values(tmp_path, leak_rank=0)
    done = subprocess.run([sys.executable, "-m", "rankmem", "report", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(LEAK_LINE.format(rank=0), done.stdout.splitlines()[-1])
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
    path = write_run(tmp_path, {"mem/host/rss_gib": np.zeros((0, WORLD))})  # the header line only
    flags = [["-o", str(tmp_path / "x.png")]] if command == "plot" else [[], ["--json"]]
    for extra in flags:
        assert main([command, str(tmp_path), *extra]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.splitlines() == [f"rankmem {command}: error: {path} {NO_STEPS[command]}"]
    assert not (tmp_path / "x.png").exists()
