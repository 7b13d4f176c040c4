"""``rankmem watch``'s screen at 80 columns: cells coloured by share of the binding limit (not by
being the highest), the worst rank marked without red, dead and exited ranks shown as such, one step
number, a title that fits; ``--once --json``; ``--wait`` for a job that starts after the watch."""

from __future__ import annotations

import io
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console

from rankmem.cli import main
from rankmem.core.catalogue import key_of
from rankmem.core.events import KilledEvent
from rankmem.forensics.events import EventWriter
from rankmem.forensics.heartbeat import Heartbeat
from rankmem.offline.watch import Watcher
from rankmem.offline.watchview import frame_json, render_frame
from tests.conftest import REPO
from tests.runlog_helpers import write_run

TOTAL = 10.0  # GiB of device memory per rank
PEAKS = [5.0, 8.5, 9.5]  # 50 %, 85 %, 95 % of it


def _run(tmp_path: Path) -> Path:
    steps = 3
    series = {
        key_of("peak_reserved"): np.array([PEAKS] * steps),
        key_of("total"): np.full((steps, 3), TOTAL),
        key_of("rss"): np.array([[1.0, 1.5, 1.2]] * steps),
    }
    write_run(tmp_path, series)
    beats = [Heartbeat(str(tmp_path / "heartbeat"), r) for r in range(3)]
    beats[0].beat(4, "rollout", None)  # two steps past the logged step 2
    beats[1].beat(2, "update", None)
    beats[2].beat(2, "update", None)
    beats[2].close()
    EventWriter(str(tmp_path), 1).write(KilledEvent(rank=1, step=2, phase="update", signal="SIGKILL",
                                                    cause="the kernel OOM killer", time=1.7e9))
    return tmp_path


def _segments(renderable: Any, width: int = 80) -> tuple[list[str], list[tuple[str, str]]]:
    console = Console(width=width, file=io.StringIO(), color_system="standard", force_terminal=True)
    lines = console.render_lines(renderable, console.options, pad=False)
    text = ["".join(s.text for s in line).rstrip() for line in lines]
    styled = [(s.text, str(s.style or "")) for line in lines for s in line]
    return text, styled


def _style_of(styled: list[tuple[str, str]], text: str) -> str:
    return next(style for t, style in styled if text in t)


def test_watch_colours_by_share_of_the_limit_and_marks_dead_ranks_at_80_columns(tmp_path: Path) -> None:
    frame = Watcher(str(_run(tmp_path))).frame()
    lines, styled = _segments(render_frame(frame))
    assert all(len(line) <= 80 for line in lines), lines
    assert lines[0].startswith("rankmem watch /tmp") and "…" in lines[0]
    assert " · 3 ranks · 1 host · step 2 (" in lines[0]
    assert lines[0].endswith(" · 1.000 s/step") or lines[0].endswith("…"), lines[0]
    assert lines[1] == "limits: device total 10.0 GiB"
    rows = {line.split()[0]: line for line in lines if line.split() and line.split()[0] in "012"}
    assert rows["0"].split()[1:3] == ["+2", "rollout"]  # its own step, relative to the one step shown
    assert rows["1"].split()[1] == "dead" and "update" not in rows["1"]
    assert rows["2"].split()[1] == "exited" and "update" not in rows["2"]
    # 50 %: plain; 85 %: yellow; 95 %: red, and the worst (rank 2): marked, bold, its colour its share's.
    assert _style_of(styled, "5.000") == ""
    assert _style_of(styled, "8.500") == "yellow"
    assert _style_of(styled, "9.500*") == "bold red"
    assert _style_of(styled, "1.500*") == "bold"  # worst rss, with no limit in the log: no colour at all
    assert "█████████░  95%" in rows["2"] and "█████░░░░░  50%" in rows["0"]
    # One step number in the title, the logged 2, not rank 0's 4. After the path: a temporary path holds digits.
    assert re.findall(r"\bstep (\d+)", lines[0].split(" · ", 1)[1]) == ["2"], lines[0]
    assert not any("4" in line.split()[1] for line in rows.values() if len(line.split()) > 1)


def test_a_healthy_job_has_no_red(tmp_path: Path) -> None:
    series = {key_of("peak_reserved"): np.array([[1.0, 3.0]] * 3), key_of("total"): np.full((3, 2), 23.5)}
    write_run(tmp_path, series)
    _, styled = _segments(render_frame(Watcher(str(tmp_path)).frame()))
    assert _style_of(styled, "3.000*") == "bold"
    assert not any("red" in style for _, style in styled)


def test_a_gone_process_on_this_host_is_dead(tmp_path: Path) -> None:
    series = {key_of("rss"): np.array([[1.0]] * 2)}
    path = write_run(tmp_path, series)
    lines = path.read_text().splitlines(keepends=True)
    lines[0] = lines[0].replace('"node0"', json.dumps(socket.gethostname()))
    path.write_text("".join(lines))
    # A rank that beat at step 1 and then vanished without closing its heartbeat (as SIGKILL leaves it).
    code = ("import os, sys; from rankmem.forensics.heartbeat import Heartbeat; "
            "Heartbeat(sys.argv[1], 0).beat(1, 'fwd', None); os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "heartbeat")], cwd=REPO, check=True, timeout=60)
    frame = Watcher(str(tmp_path)).frame()
    assert [r.dead for r in frame.rows] == [True]


def test_watch_once_json_is_the_frame(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run(tmp_path)
    assert main(["watch", "--once", "--json", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["shown_step"] == 2 and doc["world_size"] == 3
    assert [r["state"] for r in doc["rows"]] == ["running", "dead", "exited"]
    assert [r["shares"][key_of("peak_reserved")] for r in doc["rows"]] == pytest.approx([0.5, 0.85, 0.95])
    assert doc["worst"] == {key_of("peak_reserved"): 2, key_of("rss"): 1}
    assert frame_json(Watcher(str(tmp_path)).frame())["thresholds"] == {"warn": 0.8, "danger": 0.9}
    assert main(["watch", "--json", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "rankmem watch: error: --json prints one frame: use it with --once\n"


def test_watch_wait_picks_up_a_job_started_after_it(tmp_path: Path) -> None:
    run = tmp_path / "later"
    proc = subprocess.Popen([sys.executable, "-m", "rankmem", "watch", "--once", "--wait", "--interval", "0.1",
                             str(run)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            line = proc.stderr.readline() if proc.stderr else ""
            if "waiting" in line:
                break
        assert line == f"rankmem watch: waiting for a job to write {run} (Ctrl-C to stop)\n"
        assert proc.poll() is None  # still waiting: nothing there yet
        time.sleep(0.5)
        assert proc.poll() is None
        _run(run)  # the job starts: its log and heartbeats appear
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out.startswith(f"rankmem watch {run} · 3 ranks · 1 host · step 2 (")
    assert "dead" in out and "exited" in out
