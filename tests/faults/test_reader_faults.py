"""Issue 20, the readers' half: every file rankmem reads is untrusted and may not be a file at all.
FIFOs, sockets and devices where a file is expected never hang a reader; absurd numbers and nesting
in events and heartbeats are bounded; strings from a run are shown as text (no escape sequence reaches
the terminal, no rich markup is parsed); ``report --html`` on a full disk leaves no partial page; a
broken matplotlib is one line, and doctor says so. Each through the real CLI in a subprocess with a
timeout, against runs the real writer wrote."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rankmem.core.records import RankInfo, RunHeader, StepRecord
from rankmem.core.text import printable
from rankmem.forensics.heartbeat import Heartbeat
from rankmem.runlog.layout import DETAIL_NAME, RUN_LOG_NAME
from rankmem.sinks._console import ConsoleSink
from tests.conftest import REPO
from tests.runlog_helpers import known_run, write_run

ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "COLUMNS": "200"}
RAW_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u202e]")  # anything but "\n"


def _cli(*argv: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rankmem", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env or ENV)


def _one_line_or_none(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    assert len(errors) <= 1, stderr


# ---- class 2: reads never hang ------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["events/rank1.jsonl", "heartbeat/rank1.hb", DETAIL_NAME, RUN_LOG_NAME])
def test_a_fifo_where_a_file_is_expected_hangs_no_reader(tmp_path: Path, where: str) -> None:
    known_run(tmp_path)
    (tmp_path / "events").mkdir()
    (tmp_path / "heartbeat").mkdir()
    Heartbeat(str(tmp_path / "heartbeat"), 0).beat(39, "update", 1 << 30)
    (tmp_path / "events" / "rank0.jsonl").write_text('{"kind":"oom","rank":0,"step":3,"phase":"update",'
                                                     '"time":1.7e9,"where":"host","error":"MemoryError"}\n')
    target = tmp_path / where
    target.unlink(missing_ok=True)
    os.mkfifo(target)  # nobody ever opens its write end: a plain open() for reading blocks forever
    for argv in (["report", str(tmp_path)], ["watch", "--once", str(tmp_path)], ["leaks", str(tmp_path)],
                 ["plot", str(tmp_path), "-o", str(tmp_path / "p.png")]):
        done = _cli(*argv)  # a hang is a TimeoutExpired: the test fails, it does not wait forever
        _one_line_or_none(done.stderr)
        both = done.stdout + done.stderr
        if where == RUN_LOG_NAME:
            if argv[0] != "watch":
                assert done.returncode == 2 and "is a FIFO, not a regular file" in done.stderr, both
        elif where.startswith("heartbeat"):
            assert done.returncode in (0, 1), both
        else:  # leaks without per-rank values: no verdict (3); plot: nothing to draw, one line (2)
            assert done.returncode in ((0, 1) if where.startswith("events") else (0, 2, 3)), both
            if argv[0] in ("report", "watch") or where == DETAIL_NAME:
                assert "is a FIFO, not a regular file" in both, (argv, both)
    if where.startswith("events"):
        assert "EVENT oom rank 0 step 3" in _cli("report", str(tmp_path)).stdout  # the other rank's events stay


def test_a_socket_and_a_device_in_events_hang_no_reader(tmp_path: Path) -> None:
    known_run(tmp_path)
    (tmp_path / "events").mkdir()
    os.symlink("/dev/zero", tmp_path / "events" / "rank2.jsonl")  # reads without end
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(tmp_path / "events" / "rank3.jsonl"))  # open() says ENXIO
        for argv in (["report", str(tmp_path)], ["watch", "--once", str(tmp_path)]):
            done = _cli(*argv)
            _one_line_or_none(done.stderr)
            assert done.returncode == 0 and "is a character device, not a regular file" in done.stdout, done.stdout
    finally:
        server.close()


# ---- class 3: bounded input ---------------------------------------------------------------------------

def test_absurd_events_and_heartbeats_are_one_line_each_never_a_traceback(tmp_path: Path) -> None:
    known_run(tmp_path)
    (tmp_path / "events").mkdir()
    lines = [
        '{"kind":"oom","rank":0,"step":1,"phase":' + "[" * 50_000 + "]" * 50_000 + "}",  # past json's depth
        '{"kind":"oom","rank":0,"step":2,"phase":' + "[" * 200 + "]" * 200 + "}",  # parses; nested past the bound
        '{"kind":"oom","rank":' + "9" * 4000 + ',"step":3,"time":' + "1" * 4000 + ',"requested_bytes":'
        + "7" * 4000 + ',"error":"' + "x" * 1_000_000 + '"}',  # 4,000-digit integers, a 1 MB message
        '{"kind":"stalled","rank":1,"step":4,"time":1e308,"heartbeat_age_s":1e999,"last_rss_bytes":-1e308}',
        '{"kind":"oom","rank":0,"step":5,"requested_bytes":' + "1" * 5000 + "}",  # past int's digit limit
    ]
    (tmp_path / "events" / "rank0.jsonl").write_text("\n".join(lines) + "\n")
    # A heartbeat claiming rank 2**31 - 1 (watch once sized its rows by it) under rank0's name.
    Heartbeat(str(tmp_path / "heartbeat"), 2**31 - 1).close()
    os.replace(tmp_path / "heartbeat" / f"rank{2**31 - 1}.hb", tmp_path / "heartbeat" / "rank0.hb")
    for argv in (["report", str(tmp_path)], ["report", "--json", str(tmp_path)], ["watch", "--once", str(tmp_path)],
                 ["plot", str(tmp_path), "-o", str(tmp_path / "p.png")]):
        done = _cli(*argv)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr and done.stderr.strip() == "", done.stderr
    report = json.loads(_cli("report", "--json", str(tmp_path)).stdout)
    assert report["corrupt_events"] == 3  # too deep twice, past the digit limit once
    text = _cli("report", str(tmp_path)).stdout
    assert "(an integer of 4000 digits)" in text and "... (1000000 characters)" in text
    assert max(map(len, text.splitlines())) < 1000
    watch = _cli("watch", "--once", str(tmp_path)).stdout
    assert "4 ranks" in watch and "2147483647" not in watch


# ---- class 4: terminal and markup injection -----------------------------------------------------------

# Memory keys (the report's tables show those), a phase's among them (the per-phase table names it).
NASTY = ["mem/host/\x1b]0;owned\x07title_gib", "mem/host/\x1b[2Jclear_gib", "mem/host/[red]vanishes_gib",
         "mem/host/[/x]crash_gib", "mem/host/bidi\u202etxt_gib", "mem/host/<script>alert(1)</script>_gib",
         "mem/phase/[/x]\x1b[2J/peak_rss_gib"]


def _nasty_run(tmp_path: Path) -> Path:
    rng = np.random.default_rng(4)
    series = {key: 1.0 + rng.random((30, 2)) for key in NASTY}
    series["mem/host/rss_gib"] = 1.0 + np.arange(30)[:, None] * np.array([0.0, 0.02]) + rng.random((30, 2)) * 1e-3
    write_run(tmp_path, series)
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "rank1.jsonl").write_text(json.dumps({
        "kind": "oom", "rank": 1, "step": 7, "phase": "\x1b[31mupdate[/x]", "time": 1.7e9 + 7, "where": "host",
        "error": "MemoryError: \x1b]0;pwned\x07\x1b[2J[bold]boom[/bold]\r"}) + "\n")
    return tmp_path


def test_strings_from_a_run_reach_the_terminal_as_text(tmp_path: Path) -> None:
    run = _nasty_run(tmp_path)
    outputs = {}
    for argv in (["report", str(run)], ["watch", "--once", str(run)], ["leaks", "-v", str(run)],
                 ["plot", str(run), "-o", str(tmp_path / "p.png"), "--keys", *NASTY[:4]]):
        done = _cli(*argv)
        assert done.returncode in (0, 1) and "Traceback" not in done.stderr, done.stderr
        assert not RAW_CONTROL.search(done.stdout + done.stderr), repr(done.stdout)
        outputs[argv[0]] = done.stdout
    report = outputs["report"]
    unwrapped = "".join(report.split())  # the table may fold a long key over two lines
    for key in NASTY:  # shown, escaped, markup kept as text (a phase by its name, in the per-phase table)
        assert printable(key.split("/")[2] if key.startswith("mem/phase/") else key) in unwrapped, key
    assert "[red]vanishes_gib" in unwrapped and "[/x]crash_gib" in unwrapped and "\\x1b[2Jclear_gib" in unwrapped
    assert "MemoryError: \\x1b]0;pwned\\x07\\x1b[2J[bold]boom[/bold]" in report
    assert "\\x1b[31mupdate[/x]" in outputs["watch"]
    assert "rss_gib" in outputs["leaks"]
    assert "[red]vanishes_gib" in outputs["plot"]
    page = tmp_path / "r.html"
    assert _cli("report", str(run), "--html", str(page)).returncode == 0
    html = page.read_text()
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_the_console_sink_escapes_host_names(tmp_path: Path) -> None:
    import io

    out = io.StringIO()
    sink = ConsoleSink(stream=out)
    sink.open(RunHeader(world_size=1, ranks=[RankInfo(rank=0, local_rank=0, host="evil\x1b]0;t\x07", pid=1,
                                                       device="none", peak_rss_scope="window")], config={}))
    sink.write(StepRecord(step=1, time=1.0, metrics={"mem/host/rss_gib/max": 1.0}, ranks={}))
    assert not RAW_CONTROL.search(out.getvalue()) and "evil\\x1b]0;t\\x07" in out.getvalue()


# ---- class 5: one line owed ---------------------------------------------------------------------------

@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs filled to its last byte (root only; skipped elsewhere)."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("cannot run mount")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        with open(mnt / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_report_html_on_a_full_disk_is_one_line_and_leaves_no_partial_page(tmp_path: Path, full_tmpfs: Path) -> None:
    known_run(tmp_path / "run")
    os.truncate(full_tmpfs / "filler", os.path.getsize(full_tmpfs / "filler") - 8192)  # room for a few KB only
    page = full_tmpfs / "report.html"
    done = _cli("report", str(tmp_path / "run"), "--html", str(page))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [f"rankmem report: error: cannot write {page}: No space left on "
                                                f"device; {page} is as it was"]
    assert sorted(os.listdir(full_tmpfs)) == ["filler"]  # no page, no temporary file
    page.write_text("earlier page\n")  # an earlier page stays whole rather than cut
    assert _cli("report", str(tmp_path / "run"), "--html", str(page)).returncode == 2
    assert page.read_text() == "earlier page\n"


def test_a_plain_file_named_heartbeat_is_refused_before_the_earlier_run_is_moved(tmp_path: Path) -> None:
    out = tmp_path / "out"
    known_run(out)
    (out / "heartbeat").write_text("not a directory\n")
    done = _cli("train", "--out", str(out), "--steps", "2", "--nproc-per-node", "1", timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"{out / 'heartbeat'} exists and is not a directory" in done.stderr
    assert (out / RUN_LOG_NAME).exists() and not (out / f"{RUN_LOG_NAME}.1").exists()  # nothing moved aside


def test_a_matplotlib_that_fails_to_import_is_one_line_and_doctor_says_broken(tmp_path: Path) -> None:
    known_run(tmp_path / "run")
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise RuntimeError('this matplotlib is broken')\n")
    env = {**ENV, "PYTHONPATH": f"{tmp_path / 'shadow'}{os.pathsep}{ENV['PYTHONPATH']}"}
    done = _cli("plot", str(tmp_path / "run"), "-o", str(tmp_path / "p.png"), env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "needs matplotlib, which is installed but fails to import (RuntimeError('this matplotlib is broken'))" \
        in done.stderr
    page = tmp_path / "r.html"
    done = _cli("report", str(tmp_path / "run"), "--html", str(page), env=env)
    assert done.returncode == 0 and "fails to import" in page.read_text()
    doctor = _cli("doctor", env=env, timeout=120)
    line = next(line for line in doctor.stdout.splitlines() if line.strip().startswith("plot"))
    assert "broken: matplotlib (RuntimeError: this matplotlib is broken)" in line, doctor.stdout
