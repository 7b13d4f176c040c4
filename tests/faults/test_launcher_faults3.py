"""Faults of ``rankmem train``, round 3 (issue 20 items 4, 6, 7; issue 22 item 6), with real torchrun
launches: a closed stderr with chatty ranks, a rank that stops between its step window and collect(),
a SIGKILLed rank and a Ctrl-C whose diagnosis must be the last line of a short stderr, a rank's own
error shown once, and sizes no node can hold refused in one line. Every launch has a timeout."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankmem.forensics.heartbeat import read_heartbeats
from rankmem.offline import read_run
from rankmem.offline.events import read_events
from tests.conftest import REPO, sigint_as_at_a_terminal

LAUNCH_TIMEOUT_S = 150


def _cmd(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "rankmem", "train", "--nproc-per-node", "2", "--no-progress", "--task", "sft",
            "--out", str(out), "--timeout-s", str(LAUNCH_TIMEOUT_S), *args]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


@contextlib.contextmanager
def launch(out: Path, *args: str, **popen: object) -> Iterator[subprocess.Popen[str]]:
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    proc = subprocess.Popen(_cmd(out, *args), cwd=REPO, env=_env(), text=True, **popen)  # type: ignore[call-overload]
    try:
        yield proc
    finally:
        if proc.poll() is None:
            for beat in read_heartbeats(str(out / "heartbeat")).values():
                with contextlib.suppress(OSError):
                    os.kill(beat.pid, signal.SIGKILL)
            proc.kill()
            proc.communicate(timeout=30)


def _wait_rank_step(out: Path, proc: subprocess.Popen[str], rank: int, step: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the launch ended early ({proc.returncode})"
        beat = read_heartbeats(str(out / "heartbeat")).get(rank)
        if beat is not None and beat.step is not None and beat.step >= step:
            return beat.pid
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} never reached step {step}")


@pytest.mark.slow  # the relay: test_launcher_faults' closed stdout and closed stderr cases
def test_a_closed_stderr_with_chatty_ranks_neither_blocks_the_job_nor_hides_a_kill(tmp_path: Path) -> None:
    """``2>&-``: the relay keeps draining ~4 KB per rank per step (a pipe holds 64 KB: a dead relay blocked
    the ranks after ~16 steps), and a SIGKILLed rank is still named, in its event."""
    out = tmp_path / "run"
    with launch(out, "--steps", "60", "--noise-bytes", "4096", stderr=None,
                preexec_fn=lambda: os.close(2)) as proc:
        _, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S + 30)
    assert proc.returncode == 0
    assert read_run(str(out)).steps.tolist() == list(range(60))
    assert (out / "torchrun.log").read_text().count("noise step 59 ") == 2 * (4096 // 100)  # both ranks, relayed
    killed = tmp_path / "killed"
    with launch(killed, "--steps", "100000", "--noise-bytes", "4096", stderr=None,
                preexec_fn=lambda: os.close(2)) as proc:
        pid = _wait_rank_step(killed, proc, 1, 3)
        os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=LAUNCH_TIMEOUT_S + 30)
    assert proc.returncode not in (0, 124)
    (event,) = [e for e in read_events(str(killed)).events if e.kind == "killed"]
    assert (event.rank, event.signal, event.pid) == (1, "SIGKILL", pid)


@pytest.mark.slow  # a killed rank: test_train_forensics' SIGKILL case
def test_a_sigkilled_rank_is_the_last_line_of_a_short_stderr(tmp_path: Path) -> None:
    with launch(tmp_path, "--steps", "100000") as proc:
        pid = _wait_rank_step(tmp_path, proc, 1, 3)
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S + 30)
    assert proc.returncode not in (0, 124), err[-3000:]
    lines = err.strip().splitlines()
    # Before: ~50 lines, the diagnosis third, then torchrun's traceback, then "the failing rank's error is
    # above" where there was none.
    assert len(lines) < 10, err
    assert re.match(r"rankmem train: the job failed \(exit 1\): rank 1 was killed by SIGKILL at step \d+, last RSS "
                    r"[0-9.]+ GiB; cause unknown\. torchrun's report and every rank's output are in .*torchrun\.log",
                    lines[-1]), err
    assert "Traceback" not in err and "Root Cause (first observed failure)" in (tmp_path / "torchrun.log").read_text()


def test_ctrl_c_ends_with_the_launchers_line_and_the_tracebacks_go_to_a_file(tmp_path: Path) -> None:
    with launch(tmp_path, "--steps", "100000", preexec_fn=sigint_as_at_a_terminal) as proc:
        _wait_rank_step(tmp_path, proc, 1, 3)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    lines = err.strip().splitlines()
    # Before: ~200 lines of [rank0]:/[rank1]: KeyboardInterrupt tracebacks and torchrun's SignalException.
    assert len(lines) < 10 and "Traceback" not in err, err
    assert lines[-1].startswith("rankmem train: stopped by SIGINT: sent it to the job's processes"), err
    assert lines[-1].endswith(f"the job's output from then on is in {tmp_path}/torchrun.log")
    log = (tmp_path / "torchrun.log").read_text()
    assert "KeyboardInterrupt" in log or "SignalException" in log or "SIGINT" in log, log[-2000:]


def test_a_ranks_own_error_is_shown_once_and_named_last(tmp_path: Path) -> None:
    with launch(tmp_path, "--steps", "100000", "--fail-at-step", "2", "--fail-rank", "1") as proc:
        _, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S + 30)
    assert proc.returncode == 1, err[-3000:]
    shown = "".join(line for line in err.splitlines(keepends=True) if not line.startswith("rankmem train:"))
    assert shown.count("RuntimeError: injected failure on rank 1 at step 2 (--fail-at-step)") == 1, err
    assert shown.count("Traceback (most recent call last)") == 1, err  # rank 0's fallout and torchrun's: the file
    last = err.strip().splitlines()[-1]
    assert last.startswith("rankmem train: the job failed (exit 1): RuntimeError: injected failure on rank 1 at step 2"
                           " (--fail-at-step) on rank 1 (its traceback above)"), err


@pytest.mark.slow  # a stalled rank: test_train_forensics' SIGSTOP case
def test_a_rank_stopped_between_its_window_and_collect_is_named(tmp_path: Path) -> None:
    """Both ranks beat last at the same window edge; only the collect mark tells them apart (before: no
    one named, torchrun blaming the healthy rank that timed out)."""
    with launch(tmp_path, "--steps", "100000", "--stop-at-step", "3", "--fail-rank", "1", "--stop-where", "between",
                "--pg-timeout-s", "7") as proc:
        _, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S + 30)
    assert proc.returncode not in (0, 124), err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.match(r"rankmem train: the job failed \(exit 1\): rank 1 stopped making progress at step 3: "
                    r"no heartbeat for \d+ s\. ", last), err
    (event,) = [e for e in read_events(str(tmp_path)).events if e.kind == "stalled"]
    assert event.rank == 1 and event.collect_marks < event.ahead_marks


def test_sizes_no_node_can_hold_are_one_line_and_exit_2(tmp_path: Path) -> None:
    cases = {
        ("--nproc-per-node",
         "100000"): "rankmem train: error: --nproc-per-node 100000 is more ranks than this node can hold",
        ("--nproc-per-node", str(10**30)): "is more ranks than this node can hold",
        ("--batch-size", str(10**12)): "--batch-size asks for 1,000,000,000,000 sequences per rank",
        ("--steps", str(10**12)): "--steps must be at most 1,000,000,000",
        ("--nnodes", "1:99999999999"): "--nnodes must be a number of nodes in 1..65536",
        ("--timeout-s", "1e300"): "--timeout-s must be a number of seconds in (0, 31536000]",
    }
    for (flag, value), message in cases.items():
        argv = [a for a in _cmd(tmp_path / "run", flag, value)]
        done = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, (flag, done.stderr)
        assert message in done.stderr, (flag, done.stderr)
    assert not (tmp_path / "run" / "rankmem.jsonl").exists()
