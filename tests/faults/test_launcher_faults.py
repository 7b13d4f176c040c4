"""Faults of ``rankmem train`` (issue 11, items 1, 2, 3, 5), reproduced with real launches: signals to
the launcher, a closed stdout, two jobs racing for one ``--out``, and bad options caught before torchrun.
Every launch has a timeout, and every process a test starts is gone when it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rankmem.forensics import heartbeat as _heartbeat
from rankmem.offline import read_run
from rankmem.probe import procfs as _procfs
from tests.conftest import REPO

LAUNCH_TIMEOUT_S = 180
GONE_WITHIN_S = 5.0


def _train_argv(out: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rankmem", "train", "--nproc-per-node", "2", "--task", "sft", "--steps", str(steps),
            "--out", str(out), *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _start_time(pid: int) -> int | None:
    """The process's start time, or None when it is gone (a zombie has exited: it runs nothing)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return None if _procfs.parse_stat_state(data) == "Z" else _procfs.parse_stat_starttime(data)


def _tree(root: int) -> dict[int, int]:
    """Every live process from ``root`` down, by pid and start time."""
    out = {}
    for pid in {root} | _procfs.descendants(root):
        started = _start_time(pid)
        if started is not None:
            out[pid] = started
    return out


def _still_running(tree: dict[int, int]) -> list[int]:
    return [pid for pid, started in tree.items() if _start_time(pid) == started]


def _wait_for_steps(out: Path, n: int, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    log = out / "rankmem.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the launch ended early ({proc.returncode})"
        if log.exists() and log.read_text().count("\n") > n:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps in {log} after {timeout_s} s")


def _kill_all(tree: dict[int, int]) -> None:
    """The test's own cleanup, should an assertion fail with the job still running."""
    for pid in _still_running(tree):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# SIGTERM is the representative; SIGINT is test_launcher_faults3's Ctrl-C case.
@pytest.mark.parametrize("sig", [signal.SIGTERM, *(pytest.param(s, marks=pytest.mark.slow, id=s.name)
                                                   for s in (signal.SIGHUP, signal.SIGINT))],
                         ids=lambda s: s.name)
def test_a_signal_to_the_launcher_stops_every_process_of_the_job(tmp_path: Path, sig: signal.Signals) -> None:
    out = tmp_path / "run"
    stderr = (tmp_path / "stderr").open("wb")
    proc = subprocess.Popen(_train_argv(out, 100_000, "--no-progress"), cwd=REPO, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=stderr)
    tree: dict[int, int] = {}
    try:
        _wait_for_steps(out, 3, proc)
        tree = _tree(proc.pid)
        ranks = {b.pid for b in _heartbeat.read_heartbeats(str(out / "heartbeat")).values()}
        assert len(ranks) == 2 and ranks <= set(tree), (ranks, tree)
        # What made killpg(torchrun) useless: each rank leads a session of its own.
        assert all(os.getsid(pid) == pid for pid in ranks)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 128 + sig
        deadline = time.monotonic() + GONE_WITHIN_S
        while _still_running(tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _still_running(tree) == [], "processes of the job outlived the launcher"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        _kill_all(tree)
        stderr.close()
    err = (tmp_path / "stderr").read_text()
    assert f"rankmem train: stopped by {sig.name}: sent it to the job's processes (torchrun and every rank)" in err
    lines = (out / "rankmem.jsonl").read_text().count("\n")
    time.sleep(1.0)
    assert (out / "rankmem.jsonl").read_text().count("\n") == lines  # nothing trains on


def test_ranks_that_outlive_a_killed_torchrun_are_stopped(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(_train_argv(out, 100_000, "--no-progress"), cwd=REPO, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    tree: dict[int, int] = {}
    try:
        _wait_for_steps(out, 3, proc)
        time.sleep(1.5)  # the launcher has sampled the tree at least once since the ranks started
        tree = _tree(proc.pid)
        (torchrun,) = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        os.kill(torchrun, signal.SIGKILL)  # the ranks are reparented away from the launcher's tree
        _, err = proc.communicate(timeout=60)
        assert _still_running(tree) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        _kill_all(tree)
    # The two ranks: no process of rankmem's own besides them.
    assert b"2 process(es) of the job outlived torchrun; stopped them" in err
    # The launcher exits as a shell reports a death by signal N, 128 + N, and says whose it was.
    assert proc.returncode == 128 + signal.SIGKILL, (proc.returncode, err[-2000:])
    assert b"the job failed (exit 137: torchrun was killed by SIGKILL)" in err, err[-2000:]


@pytest.mark.timeout(240)
def test_a_closed_stdout_never_stops_training(tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = _train_argv(out, 30, "--no-progress")  # a progress line every 3 steps: the pipe closes at once
    # `rankmem train ... | head -1`: head exits after the first line; the exit status is rankmem's.
    proc = subprocess.run(["bash", "-c", '"$@" | head -1; exit "${PIPESTATUS[0]}"', "bash", *argv], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("\n") == 1 and proc.stdout.startswith("rankmem train: live view: ")  # head's one line
    assert proc.stderr.count("rankmem: stdout is closed (a `| head`, or a tee that exited); progress output is "
                             "dropped from here on and training goes on") == 1
    run = read_run(str(out))
    assert run.steps.tolist() == list(range(30)) and run.corrupt == 0


def test_torchruns_stderr_is_drained_when_our_own_stderr_is_closed() -> None:
    import io
    import threading

    from rankmem.cli._train import StderrRelay

    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    read_end, write_end = os.pipe()
    relay = StderrRelay(os.fdopen(read_end, "rb"), ClosedPipe())
    # 4 MiB, far past a pipe's 64 KiB: a relay that stopped reading would leave this writer blocked
    # (and torchrun with it).
    writer = threading.Thread(target=lambda: [os.write(write_end, b"x" * 1023 + b"\n") for _ in range(4096)])
    writer.start()
    writer.join(30)
    assert not writer.is_alive()
    os.close(write_end)
    relay.wait(30)
    relay.release()  # nothing raised: the lines are dropped
    assert len(relay.tail) == 2000


@pytest.mark.slow  # the lock, in-process: test_engine's refused-by-lock case
@pytest.mark.timeout(240)
def test_two_jobs_racing_for_one_out_dir_one_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    procs = [subprocess.Popen(_train_argv(out, 4, "--no-progress"), cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        results = [p.communicate(timeout=LAUNCH_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], results
    refused = results[[p.returncode for p in procs].index(2)][1]
    assert refused.startswith(f"rankmem train: error: --out {out} is in use by another rankmem job (pid ")
    assert refused.count("\n") == 1 and "choose another run directory" in refused
    run = read_run(str(out))  # the winner's log, whole and alone
    assert run.steps.tolist() == [0, 1, 2, 3] and run.corrupt == 0 and not run.truncated
    assert not (out / "rankmem.jsonl.1").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--out", "{file}"], "--out {file} is a file: it names the run directory (the run log is OUT/rankmem.jsonl)"),
        (["--out", "/proc/nope"], "--out /proc/nope: cannot create the run directory (No such file or directory)"),
        (["--pg-timeout-s", "inf"], "--pg-timeout-s must be a number of seconds in 1..31536000 (a year), got inf"),
        (["--pg-timeout-s", "1e-9"], "--pg-timeout-s must be a number of seconds in 1..31536000 (a year), got 1e-09"),
        (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
        (["--timeout-s", "nan"], "--timeout-s must be a number of seconds in (0, 31536000] (a year), got nan"),
        (["--nnodes", "0"], "--nnodes must be a number of nodes in 1..65536, or MIN:MAX with 1 <= MIN <= MAX; got '0'"),
        (["--nnodes", "3:2"],
         "--nnodes must be a number of nodes in 1..65536, or MIN:MAX with 1 <= MIN <= MAX; got '3:2'"),
        (["--node-rank", "1"], "--node-rank must be in 0..0 (--nnodes 1), got 1"),
        (["--seed", "-1"], "--seed must be in 0..4294967295, got -1"),
    ],
)
def test_every_job_option_is_checked_before_torchrun_starts(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from rankmem.cli import _train, main

    def no_launch(*a: object, **k: object) -> None:
        raise AssertionError("launched torchrun despite a bad option")

    monkeypatch.setattr(_train.subprocess, "Popen", no_launch)
    monkeypatch.chdir(tmp_path)  # the default --out (runs/train) is created here, if anywhere
    (tmp_path / "a_file").write_text("not a directory")
    args = [a.replace("{file}", str(tmp_path / "a_file")) for a in args]
    assert main(["train", *args]) == 2
    assert capsys.readouterr().err == f"rankmem train: error: {message.replace('{file}', str(tmp_path / 'a_file'))}\n"


def test_device_cuda_on_a_build_without_cuda_is_one_line(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch

    from rankmem.cli import _train, main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.setattr(_train.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rankmem train: error: --device cuda, but this torch {torch.__version__} has no CUDA device "
                          "(")
    assert err.endswith("): use --device cpu, or auto\n") and err.count("\n") == 1


def _fake_proc(root: Path, pid: int, start: int, children: tuple[int, ...] = (), environ: bytes = b"",
               state: str = "S") -> None:
    task = root / str(pid) / "task" / str(pid)
    task.mkdir(parents=True, exist_ok=True)
    (task / "children").write_text(" ".join(map(str, children)) + (" " if children else ""))
    fields = [state] + ["0"] * 18 + [str(start)]  # field 3 (state) .. field 22 (start time)
    (root / str(pid) / "stat").write_text(f"{pid} (python) " + " ".join(fields) + " 0 0\n")
    (root / str(pid) / "environ").write_bytes(environ)


def test_the_job_tree_never_takes_a_reused_pid_or_a_stranger(tmp_path: Path) -> None:
    from rankmem.cli._jobtree import JobTree

    mark = "RANKMEM_HEARTBEAT_DIR=/runs/x/heartbeat"
    _fake_proc(tmp_path, 100, 10, (101,))  # torchrun
    _fake_proc(tmp_path, 101, 11, environ=mark.encode() + b"\0")  # rank 0
    _fake_proc(tmp_path, 300, 12, environ=b"RANKMEM_HEARTBEAT_DIR=/runs/other/heartbeat\0")  # another job's rank
    tree = JobTree(100, mark, proc=str(tmp_path))
    _fake_proc(tmp_path, 100, 10, ())  # rank 1 (pid 102) was never seen below torchrun ...
    _fake_proc(tmp_path, 102, 13, environ=b"A=1\0" + mark.encode() + b"\0")  # ... but its environment says it is ours
    tree.refresh([102, 300])  # the pids the heartbeats name
    assert sorted(tree.alive()) == [100, 101, 102]
    _fake_proc(tmp_path, 101, 99)  # rank 0 exited and the kernel gave its pid to another process
    _fake_proc(tmp_path, 102, 13, state="Z")  # rank 1 exited, not yet reaped
    assert tree.alive() == [100]
