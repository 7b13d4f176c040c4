"""``rankmem watch``: the run log's tail read from its end, the frame built from log, heartbeats and
events, and the command driven against a real ``rankmem train`` job while it writes (``--once`` with
the ranks paused, so what is shown can be compared with the files exactly; then the live view in a
pseudo-terminal for a few redraws, ended by SIGINT)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from rankmem.cli import main
from rankmem.core.catalogue import key_of, worse
from rankmem.core.events import NearOomEvent
from rankmem.forensics.events import EventWriter
from rankmem.forensics.heartbeat import Heartbeat, read_heartbeats
from rankmem.offline import read_run
from rankmem.offline.follow import FIRST_BLOCK, Follower, read_last_steps
from rankmem.offline.watch import COLUMNS, Watcher, build_frame
from rankmem.runlog import RUN_LOG_NAME
from rankmem.runlog.layout import DETAIL_NAME
from tests.conftest import REPO, run_at_a_terminal
from tests.runlog_helpers import run_with_events, write_run

TRAIN_TIMEOUT_S = 240


# ---- the tail ----------------------------------------------------------------------------------------

def test_tail_skips_a_line_being_written_and_corrupt_lines(tmp_path: Path) -> None:
    path = write_run(tmp_path, {key_of("rss"): np.arange(12.0).reshape(6, 2)})
    with open(path, "a") as f:
        f.write('{not json\n{"kind":"step","step":99,"ti')  # a corrupt line, then one cut mid-write
    steps, _ = read_last_steps(str(path), 2)
    assert [s["step"] for s in steps] == [4, 5]
    assert steps[-1]["metrics"][key_of("rss") + "/max"] == 11.0
    steps, _ = read_last_steps(str(path), 100)  # fewer in the file: all of them, header skipped
    assert [s["step"] for s in steps] == list(range(6))


def test_tail_reads_a_bounded_amount_of_a_big_log_and_grows_for_long_lines(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = write_run(tmp_path, {key_of("rss"): rng.random((3000, 8))})
    size = path.stat().st_size
    steps, nread = read_last_steps(str(path), 2)
    assert [s["step"] for s in steps] == [2998, 2999] and nread == FIRST_BLOCK < size
    # ~300 KB lines: the aggregates of 3,000 keys.
    wide = write_run(tmp_path / "wide", {f"k{i}": rng.random((3, 2)) for i in range(3000)})
    steps, nread = read_last_steps(str(wide), 2)
    assert [s["step"] for s in steps] == [1, 2] and FIRST_BLOCK < nread <= wide.stat().st_size


def test_follower_rereads_only_on_change_and_follows_a_rotation(tmp_path: Path) -> None:
    write_run(tmp_path, {key_of("rss"): np.ones((3, 2))})
    follower = Follower(str(tmp_path / RUN_LOG_NAME))
    assert [s["step"] for s in follower.poll().steps] == [1, 2]
    assert follower.poll().bytes_read == 0  # unchanged: nothing read
    os.replace(tmp_path / RUN_LOG_NAME, tmp_path / "rankmem.jsonl.1")  # a restart moved it aside...
    assert follower.poll().steps == []
    write_run(tmp_path, {key_of("rss"): np.ones((1, 4))})  # ...and a new run began
    tail = follower.poll()
    assert tail.header is not None and tail.header.world_size == 4 and [s["step"] for s in tail.steps] == [0]


# ---- the frame -----------------------------------------------------------------------------------------

def test_frame_marks_the_worst_rank_per_column_in_the_catalogues_direction(tmp_path: Path) -> None:
    rss = np.array([[1.0, 2.0, 3.0], [1.0, 2.5, 2.0]])
    headroom = np.array([[5.0, 1.0, 9.0], [5.0, 4.0, 0.5]])
    children = np.zeros((2, 3))
    write_run(tmp_path, {key_of("rss"): rss, key_of("headroom"): headroom, key_of("children_rss"): children})
    beats = [Heartbeat(str(tmp_path / "heartbeat"), r) for r in range(3)]
    beats[0].beat(2, "rollout", None)
    beats[2].beat(2, "", None)
    beats[1].close()
    EventWriter(str(tmp_path), 2).write(NearOomEvent(step=1, phase="update", reasons=("low",)))
    frame = Watcher(str(tmp_path)).frame()
    assert frame.step == 1 and frame.world_size == 3 and frame.step_time_s == pytest.approx(1.0)
    assert [label for label, _ in frame.columns] == ["rss", "headroom", "children"]
    assert worse(key_of("headroom")) == "low"
    assert frame.worst == {key_of("rss"): 1, key_of("headroom"): 2}  # all-zero children: no worst rank
    assert [(r.step, r.phase, r.exited) for r in frame.rows] == [(2, "rollout", False), (None, "", True),
                                                                  (2, "", False)]
    assert [e.kind for e in frame.events] == ["near_oom"]


def test_frame_before_the_first_step_comes_from_heartbeats(tmp_path: Path) -> None:
    Heartbeat(str(tmp_path / "heartbeat"), 1).beat(None, "", None)
    frame = build_frame(str(tmp_path), Follower(str(tmp_path / RUN_LOG_NAME)).poll(),
                        read_heartbeats(str(tmp_path / "heartbeat")), [])
    assert frame.step is None and frame.world_size == 2 and frame.columns == []


def test_once_on_a_directory_with_nothing_yet_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["watch", "--once", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"rankmem watch: error: nothing to show in {tmp_path} yet: no run log lines and no heartbeats "
        f"(expected {tmp_path}/rankmem.jsonl and {tmp_path}/heartbeat); --wait waits for them\n"
    )


# ---- against a real job ----------------------------------------------------------------------------------

def _wait_for(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _logged_steps(out: Path) -> int:
    try:
        return max(0, (out / RUN_LOG_NAME).read_bytes().count(b"\n") - 1)
    except OSError:
        return 0


def _run_live_in_pty(run: Path, frames_seen: int, out: Path, timeout: float = 60) -> tuple[int, str]:
    """Live ``rankmem watch`` at a terminal; once two frames are drawn an event is written to ``out``, and
    it is stopped when ``frames_seen`` frames and that event have been shown."""
    event_written = False

    def done(text: str) -> bool:
        nonlocal event_written
        shown = text.count("rankmem watch ")
        if shown >= 2 and not event_written:  # an event written while it runs shows up in a later frame
            EventWriter(str(out), 1).write(NearOomEvent(step=3, phase="update", reasons=("test",)))
            event_written = True
        return shown >= frames_seen and "near_oom rank 1 step 3 phase update: test" in text

    return run_at_a_terminal([sys.executable, "-m", "rankmem", "watch", str(run), "--interval", "0.2"], cwd=REPO,
                             env=dict(os.environ), done=done, timeout=timeout)


LIVE_STEPS = 100


def test_watch_follows_a_real_job(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Long enough that a fast machine is still training when it is paused: the wait below holds at the
    # 4th step (0.6 s after the first, at a load of 4), and 96 steps then take ~17 s here.
    job = subprocess.Popen([sys.executable, "-m", "rankmem", "train", "--task", "grpo", "--steps", str(LIVE_STEPS),
                            "--nproc-per-node", "2", "--no-progress", "--out", str(out)],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(lambda: _logged_steps(out) >= 4 and len(read_heartbeats(str(out / "heartbeat"))) == 2
                  and Follower(str(out / RUN_LOG_NAME)).poll().detail is not None,
                  120, "the job's first steps")
        # Pause both ranks, so the log and heartbeats hold still while --once reads them.
        beats = read_heartbeats(str(out / "heartbeat"))
        for b in beats.values():
            os.kill(b.pid, signal.SIGSTOP)
        try:
            time.sleep(0.3)
            last = read_last_steps(str(out / RUN_LOG_NAME), 1)[0][-1]
            # The per-rank values: the side file's newest collect, written with its line.
            detail = Follower(str(out / RUN_LOG_NAME)).poll().detail
            beats = read_heartbeats(str(out / "heartbeat"))
            once = subprocess.run([sys.executable, "-m", "rankmem", "watch", "--once", "--json", str(out)], cwd=REPO,
                                  capture_output=True, text=True, timeout=60)
            screen = subprocess.run([sys.executable, "-m", "rankmem", "watch", "--once", str(out)], cwd=REPO,
                                  capture_output=True, text=True, timeout=60)
        finally:
            for b in beats.values():
                os.kill(b.pid, signal.SIGCONT)
        assert once.returncode == 0, once.stderr
        assert "ranks" not in last and detail is not None and detail[0] <= last["step"]
        per_rank = detail[1]
        doc = json.loads(once.stdout)
        assert doc["step"] == last["step"] and doc["detail_step"] == detail[0], once.stdout
        assert doc["shown_step"] == detail[0] and f" · step {detail[0]} (" in screen.stdout, screen.stdout
        columns = [(label, key_of(name)) for label, name in COLUMNS if key_of(name) in per_rank]
        assert [tuple(c) for c in doc["columns"]] == columns
        assert [r["rank"] for r in doc["rows"]] == [0, 1], once.stdout
        for row in doc["rows"]:
            rank = row["rank"]
            assert (row["step"], row["phase"], row["state"]) == (beats[rank].step, beats[rank].phase, "running")
            assert row["phase"] in ("rollout", "log_prob", "update", "")
            for label, key in columns:
                assert row["values"][key] == per_rank[key][rank]
                vec = per_rank[key]
                if len(set(vec)) == 1:
                    assert key not in doc["worst"], (label, once.stdout)
                    continue
                target = min(vec) if worse(key) == "low" else max(vec)
                assert (doc["worst"][key] == rank) == (rank == vec.index(target)), (label, vec, once.stdout)

        rc, text = _run_live_in_pty(out, frames_seen=4, out=out)
        assert rc == 0, text[-3000:]
        assert text.count("rankmem watch ") >= 4 and "near_oom rank 1 step 3 phase update: test" in text, text[-3000:]
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
        assert job.wait(timeout=TRAIN_TIMEOUT_S) == 0, job.stdout.read() if job.stdout else ""
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGINT)  # rankmem train stops torchrun and its workers on Ctrl-C
            job.wait(timeout=60)
    # After the job: --once still works, every rank shown as exited.
    done = subprocess.run([sys.executable, "-m", "rankmem", "watch", "--once", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.count(" exited ") == 2, done.stdout
    assert json.loads((out / RUN_LOG_NAME).read_text().splitlines()[-1])["step"] == LIVE_STEPS - 1


# ---- rankmem watch crashes on a step line the reader counts as corrupt --------------------------

@pytest.mark.parametrize("bad", ['{"kind":"step","step":null,"time":5.0,"metrics":{}}',
                                 '{"kind":"step","step":3.5,"time":5.0,"metrics":{}}'])
def test_watch_skips_a_corrupt_last_step_line(tmp_path: Path, bad: str) -> None:
    """read_last_steps accepts any object with kind=step and a metrics dict; build_frame then does
    int(last["step"]) (TypeError on null) and step.get("ranks", {}).get(...) (AttributeError on null).
    read_run counts the same line as corrupt and reads on."""
    from rankmem.offline.watch import Watcher
    from tests.runlog_helpers import write_run

    write_run(tmp_path, {"mem/host/rss_gib": np.array([[1.0, 2.0], [1.5, 2.5]])})
    with open(tmp_path / "rankmem.jsonl", "a") as f:
        f.write(bad + "\n")
    assert read_run(str(tmp_path)).corrupt_lines == [4]
    frame = Watcher(str(tmp_path)).frame()
    assert frame.step == 1
    assert frame.rows[1].values["mem/host/rss_gib"] == 2.5


# ---- rankmem watch reads the whole side file into memory at its first frame ----------------------

def test_watch_first_frame_does_not_read_the_whole_side_file(tmp_path: Path) -> None:
    """The follower maps the side file and walks it: on a long run at scale (1,024 ranks x 28 keys x
    100k steps is ~23 GB of side file) its first poll must not hold the file on the heap."""
    import tracemalloc

    from tests.runlog_helpers import write_run

    steps, world = 1500, 64
    rng = np.random.default_rng(0)
    write_run(tmp_path, {f"k{i}": rng.random((steps, world)) for i in range(8)})
    size = (tmp_path / DETAIL_NAME).stat().st_size
    follower = Follower(str(tmp_path / RUN_LOG_NAME))
    tracemalloc.start()
    latest = follower.poll().detail
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert latest is not None and latest[0] == steps - 1
    assert peak < size / 4, f"the first poll held {peak / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB side file"



def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_watch_once_with_an_event_time_out_of_range_is_not_a_traceback(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """An event whose "time" is 1e20 (or NaN, accepted by json.loads): time.localtime raises
    OverflowError / ValueError in render_frame."""
    run = run_with_events(tmp_path, '{"kind":"oom","rank":0,"step":1,"phase":null,"time":1e20}')
    rc, out, err = _cli(capsys, "watch", "--once", str(run))
    assert rc == 0 and "oom rank 0" in out



def test_watch_once_with_a_damaged_world_size_is_one_error_line(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """build_frame does int(header["world_size"]) unchecked: "two" raises ValueError (and 10**9 would
    build a billion rows); read_run refuses both with a RankmemError naming the damaged header."""
    (tmp_path / "rankmem.jsonl").write_text(
        '{"kind":"header","schema":3,"world_size":"two","detail":"rankmem.ranks.f64"}\n'
        '{"kind":"step","step":1,"time":1.0,"metrics":{}}\n')
    rc, out, err = _cli(capsys, "watch", "--once", str(tmp_path))
    assert rc == 2 and "world_size" in err
