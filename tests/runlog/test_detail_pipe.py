"""The side file's writer process (rankmem.runlog.detail_pipe / detail_child): the rank never blocks on
it, it writes what it was sent even when its rank is SIGKILLed, and it does not outlive its rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from rankmem.core.records import StepRecord
from rankmem.offline import read_run
from rankmem.runlog import detail_pipe
from rankmem.runlog.detail_pipe import DetailPipe
from tests.conftest import REPO


def _writers(marker: str) -> list[int]:
    """Live writer processes whose command line names ``marker`` (the side file's path)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"rankmem.runlog.detail_child" in cmd and marker.encode() in b" ".join(cmd) and state != "Z":
            found.append(int(pid))
    return found


def test_a_killed_rank_s_writer_writes_what_it_got_and_exits(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import rankmem
        monitor = rankmem.Monitor(out_dir={str(tmp_path)!r}, device="cpu", children=False, near_oom_watch=False)
        for step in range(20):
            monitor.collect({{"step_echo": float(step)}}, step=step)
        monitor.flush(30)
        print("ready", flush=True)
        import time
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert len(_writers(str(tmp_path))) == 1
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    deadline = time.monotonic() + 15
    while _writers(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _writers(str(tmp_path)) == []  # it ended with its rank
    run = read_run(str(tmp_path))
    assert run.logged is None and run.series["step_echo"][:, 0].tolist() == [float(s) for s in range(20)]


def _record(step: int, world: int) -> StepRecord:
    keys = ("a", "b")
    metrics = {f"{k}/{s}": float(step) for k in keys for s in ("max", "min", "mean", "max_rank", "min_rank")}
    return StepRecord(step, time.time(), metrics, keys=keys, matrix=np.full((world, 2), float(step)))


def test_a_stopped_writer_never_blocks_the_rank_and_what_waits_is_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    world = 256
    monkeypatch.setattr(detail_pipe, "MAX_QUEUED_BYTES", 1 << 20)
    pipe = DetailPipe(str(tmp_path / "side.arrow"), world)
    pipe.open()
    assert pipe._proc is not None
    os.kill(pipe._proc.pid, signal.SIGSTOP)  # a writer that takes nothing: the pipe fills, then the queue
    try:
        start = time.monotonic()
        for step in range(2000):  # ~8 MiB of per-rank values, 8x the bound
            pipe.add(step, _record(step, world), 0)
        assert time.monotonic() - start < 5.0  # no add waited for the writer
        assert pipe._queued <= 1 << 20 and pipe.dropped > 0
        assert not pipe.flush(timeout=0.5)  # a flush says it did not finish, and returns
    finally:
        os.kill(pipe._proc.pid, signal.SIGCONT)
    assert pipe.flush(timeout=30)
    pipe.close()
    assert pipe._proc is None
    # Every collect reached the side file: those shed keep their aggregates, the rest their values too.
    import pyarrow as pa

    with pa.ipc.open_stream(str(tmp_path / "side.arrow")) as reader:
        table = reader.read_all()
    assert sorted(set(table.column("collect").to_pylist())) == list(range(2000))
    assert table.column("max").to_pylist()[:2] == [0.0, 1.0]
    with_values = sum(v is not None for v in table.column("ranks").to_pylist()) // 2
    assert with_values == 2000 - pipe.dropped and pipe.dropped > 1000


def test_close_warns_only_when_the_writer_had_to_be_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer that finishes says nothing; one that does not finish in time is killed, with one warning,
    and neither stays among rankmem's helpers (the children figures' exclusions)."""
    import warnings

    from rankmem.core.helpers import helper_pids

    others = helper_pids()  # writers of the suite's other monitors, if one is still open
    pipe = DetailPipe(str(tmp_path / "ok.arrow"), 2)
    pipe.open()
    pipe.add(0, _record(0, 2), 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.close()
    assert [str(w.message) for w in caught] == [] and helper_pids() == others

    monkeypatch.setattr(detail_pipe, "EXIT_TIMEOUT_S", 1.0)
    stuck = DetailPipe(str(tmp_path / "stuck.arrow"), 2)
    stuck.open()
    assert stuck._proc is not None
    pid = stuck._proc.pid
    assert stuck.flush(30)  # started and answering
    os.kill(pid, signal.SIGSTOP)  # takes the close frame into the pipe's buffer, never acts on it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.monotonic()
        stuck.close()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "was killed" in messages[0], messages
    assert time.monotonic() - start < 1.0 + 5  # the close's bound, then the kill's reap
    assert helper_pids() == others and _writers(str(tmp_path / "stuck.arrow")) == []


def test_a_writer_that_dies_costs_one_warning_and_leaves_no_helper_behind(tmp_path: Path) -> None:
    """The writer is SIGKILLed mid-run: the next collects find its pipe broken, say so once, count what
    they could not send, and neither the rank's adds nor its close wait on it."""
    import warnings

    from rankmem.core.helpers import helper_pids

    others = helper_pids()
    pipe = DetailPipe(str(tmp_path / "side.arrow"), 2)
    pipe.open()
    assert pipe._proc is not None
    pid = pipe._proc.pid
    pipe.add(0, _record(0, 2), 0)
    assert pipe.flush(30)
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.monotonic()
        for step in range(1, 6):
            pipe.add(step, _record(step, 2), 0)
        pipe.close()
        took = time.monotonic() - start
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "exited with code -9" in messages[0], messages
    assert took < 2.0 and pipe.dropped >= 1
    assert helper_pids() == others and _writers(str(tmp_path)) == []
