"""Nothing makes the run log silently shorter: a stalled tracker, a loop faster than the disk, a full
disk, a stuck writer, a signal to the process group. Each with real threads and processes: every
collected step is in the log with its per-rank values, or named in a gap record the readers print."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import rankmem
from rankmem.core.records import RunHeader, StepRecord
from rankmem.offline import read_run
from rankmem.offline.runlog import Gap
from rankmem.publish.publisher import RunLogQueue
from rankmem.runlog import RunLogWriter
from tests.conftest import REPO


class _StallingSink:
    """A tracker that stalls for ``stall_s`` once, at ``at`` (a network hiccup of W&B or MLflow)."""

    def __init__(self, at: int, stall_s: float) -> None:
        self.at, self.stall_s, self.seen = at, stall_s, 0

    def open(self, header: RunHeader) -> None:
        pass

    def write(self, record: StepRecord) -> None:
        self.seen += 1
        if record.step == self.at:
            time.sleep(self.stall_s)

    def close(self) -> None:
        self.closed = True


def _monitor(out: Path, *sinks: object) -> rankmem.Monitor:
    return rankmem.Monitor(out_dir=str(out), device="cpu", children=False, leak_check=False, near_oom_watch=False,
                           sinks=("jsonl", *sinks))  # type: ignore[arg-type]


def _covered(run: rankmem.offline.Run) -> set[int]:
    """Steps with per-rank values, and steps a gap record names."""
    out = {int(s) for s in run.steps}
    for gap in run.gaps:
        out.update(range(gap.first, gap.last + 1))
    return out


def test_a_stalled_tracker_costs_the_run_log_nothing(tmp_path: Path) -> None:
    stall = _StallingSink(at=100, stall_s=5.0)
    monitor = _monitor(tmp_path, stall)
    for step in range(700):
        monitor.collect({"loss": float(step)}, step=step)
        time.sleep(0.01)
    monitor.close()
    run = read_run(str(tmp_path))
    assert run.steps.tolist() == list(range(700)) and run.gaps == []  # before: 95-162 of 700 lost
    assert run.series["loss"][:, 0].tolist() == [float(s) for s in range(700)]
    assert stall.seen < 700  # the tracker shed its own records meanwhile (its queue of 256 overran)


BUSY = "import time\nend = time.time() + 120\nwhile time.time() < end: pass\n"


def test_a_fast_loop_under_contention_logs_every_step_or_names_it(tmp_path: Path) -> None:
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2)]
    try:
        monitor = _monitor(tmp_path)
        for step in range(8000):
            monitor.collect({"loss": 1.0}, step=step)
            time.sleep(0.001)
        monitor.close()
    finally:
        for proc in busy:
            proc.kill()
            proc.wait(timeout=30)
    run = read_run(str(tmp_path))
    assert _covered(run) == set(range(8000))  # before: 4,550 of 8,000 lost without a word
    out = subprocess.run([sys.executable, "-m", "rankmem", "report", str(tmp_path)], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\ngap: ") == len(run.gaps)


class _SlowWriter(RunLogWriter):
    """A run log on a disk that stops for a while at step 10 (while the loop runs on)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.go = threading.Event()

    def write(self, rec: StepRecord) -> None:
        if rec.step == 10:
            self.go.wait(30)
        super().write(rec)


def test_a_queue_overrun_is_a_gap_record_that_every_reader_prints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    monkeypatch.setattr(RunLogQueue, "MAX_PENDING", 16)
    writer = _SlowWriter(str(tmp_path / "rankmem.jsonl"))
    monitor = rankmem.Monitor(out_dir=None, device="cpu", children=False, leak_check=False, near_oom_watch=False,
                               sinks=(writer,))  # type: ignore[arg-type]
    for step in range(300):
        monitor.collect({"loss": float(step)}, step=step)
    writer.go.set()
    monitor.close()
    run = read_run(str(tmp_path))
    dropped = sum(g.count for g in run.gaps)
    assert run.gaps and dropped == 300 - run.steps.size
    assert _covered(run) == set(range(300))
    assert all("queue overran" in g.why for g in run.gaps)
    assert _gap_lines(tmp_path) == run.gaps
    for command in ("report", "leaks", "advise", "watch --once"):
        out = subprocess.run([sys.executable, "-m", "rankmem", *command.split(), str(tmp_path)], capture_output=True,
                             text=True, timeout=120, cwd=REPO)
        said = [line for line in (out.stdout + out.stderr).splitlines() if "gap: " in line]
        assert len(said) >= len(run.gaps) and all("queue overran" in line for line in said), (command, out)
        assert str(run.gaps[0]) in out.stdout + out.stderr, command


def _gap_lines(run_dir: Path) -> list[Gap]:
    """The gaps as a JSON-lines reader (jq, pandas) sees them: the log's lines of kind "gap"."""
    objs = [json.loads(line) for line in (run_dir / "rankmem.jsonl").read_text().splitlines()]
    return [Gap(o["first"], o["last"], o["count"], o["why"]) for o in objs if o["kind"] == "gap"]


FULL_DISK = """
import resource, signal, rankmem
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
m = rankmem.Monitor(out_dir={out!r}, device="cpu", children=False, leak_check=False, near_oom_watch=False)
for s in range(40):
    m.collect({{"loss": float(s)}}, step=s)
m.flush()
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (8192 * 8, hard))  # the side file is past this: the disk is full
for s in range(40, 60):
    m.collect({{"loss": float(s)}}, step=s)
m.flush()
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space again
for s in range(60, 80):
    m.collect({{"loss": float(s)}}, step=s)
m.close()
"""


def test_a_full_disk_is_a_gap_record_once_the_disk_takes_writes_again(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(FULL_DISK.format(out=str(tmp_path)))],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    run = read_run(str(tmp_path))
    kept = set(run.steps.tolist())
    assert set(range(40)) <= kept and set(range(60, 80)) <= kept
    assert len(run.gaps) == 1 and "the disk refused it" in run.gaps[0].why
    gap = run.gaps[0]
    assert set(range(gap.first, gap.last + 1)) | kept == set(range(80)) and gap.count == 80 - len(kept)
    assert _gap_lines(tmp_path) == run.gaps and run.slow_lines == 0  # the fast path skips the gap line
    (tmp_path / "rankmem.ranks.f64").unlink()  # the lines alone still say it
    assert read_run(str(tmp_path)).gaps == run.gaps
    out = subprocess.run([sys.executable, "-m", "rankmem", "report", str(tmp_path)], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert f"\ngap: {gap}\n" in out.stdout, out


class _StuckWriter(RunLogWriter):
    """A run log whose disk hangs (a hung mount, a frozen cgroup): a write never returns."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.release = threading.Event()

    def write(self, rec: StepRecord) -> None:
        if rec.step >= 5:
            self.release.wait()
        super().write(rec)


def test_close_returns_within_its_bound_whatever_the_writer_does(tmp_path: Path) -> None:
    """The run log's stuck writer takes at most its share of the bound: a healthy tracker is still closed."""
    writer, tracker = _StuckWriter(str(tmp_path / "rankmem.jsonl")), _StallingSink(at=-1, stall_s=0.0)
    monitor = rankmem.Monitor(out_dir=None, device="cpu", children=False, leak_check=False, near_oom_watch=False,
                              sinks=(writer, tracker))  # type: ignore[arg-type]
    for step in range(20):
        monitor.collect({"loss": 1.0}, step=step)
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        monitor.close()
    took = time.monotonic() - t0
    writer.release.set()
    said = [str(w.message) for w in warned]
    assert len(said) == 1 and re.search(r"RunLogQueue's writer did not finish within 4 s of close\(\); \d+ record\(s\) "
                                        "not written", said[0]), said
    assert getattr(tracker, "closed", False) and tracker.seen == 20
    assert took < RunLogQueue.FLUSH_TIMEOUT_S + 1.5, took  # before: 20 s, and 27 s after a flush(3)
    assert read_run(str(tmp_path)).steps.tolist()[:5] == [0, 1, 2, 3, 4]


LOOP = """
import rankmem
m = rankmem.Monitor(out_dir={out!r}, device="cpu", children=False, leak_check=False, near_oom_watch=False)
for s in range(10**7):
    m.collect({{"loss": float(s)}}, step=s)
    print(s, flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_to_the_process_group_leaves_every_collected_step_with_its_values(
        tmp_path: Path, sig: signal.Signals) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LOOP.format(out=str(tmp_path)))], env=env,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    last = -1
    try:
        for line in proc.stdout:
            last = int(line)
            if last >= 300:
                os.killpg(proc.pid, sig)
                break
        rest, _ = proc.communicate(timeout=60)
        printed = [int(x) for x in rest.split()]
        last = printed[-1] if printed else last
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    run = read_run(str(tmp_path))
    assert run.steps.tolist()[: last + 1] == list(range(last + 1)) and run.logged is None
    assert np.array_equal(run.series["loss"][: last + 1, 0], np.arange(last + 1, dtype=float))


@pytest.mark.timeout(900)
# Round 0 in the default selection; the later rounds (SIGTERM at later steps) behind the slow marker.
@pytest.mark.parametrize("round_", [0, *(pytest.param(r, marks=pytest.mark.slow) for r in (1, 2))])
def test_sigterm_to_a_two_rank_train_leaves_every_collected_step_with_its_values(tmp_path: Path,
                                                                                  round_: int) -> None:
    """``timeout``, Slurm's preemption and ``--timeout-s`` send SIGTERM to the whole job: before, the
    side file's writer process died at once and 93 of 250 steps lost their per-rank values."""
    from rankmem.forensics.heartbeat import read_heartbeats

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rankmem", "train", "--nproc-per-node", "2", "--task", "sft",
                             "--steps", "100000", "--no-progress", "--out", str(out)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        log = out / "rankmem.jsonl"
        while not (log.exists() and log.read_bytes().count(b"\n") > 20 + 15 * round_):
            assert proc.poll() is None and time.monotonic() < deadline, "the job did not start logging"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher's group; it forwards to the job's
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)
    run = read_run(str(out))
    beats = read_heartbeats(str(out / "heartbeat"))
    steps = run.steps.tolist()
    assert steps == list(range(len(steps))) and run.logged is None and run.gaps == [], (steps[-5:], err[-2000:])
    # Rank 0's last window edge was at most one step past its last collect (the step it was in).
    assert beats[0].step is not None and beats[0].step <= steps[-1] + 1, (beats[0].step, steps[-1])
    values = run.series["mem/host/rss_gib"]
    assert values.shape == (len(steps), 2) and np.isfinite(values).all() and (values > 0.05).all()
