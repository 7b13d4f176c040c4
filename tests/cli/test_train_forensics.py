"""``rankmem train`` naming the rank that died or hung, on real torchrun launches: a rank SIGKILLed from
outside, a rank stopped with SIGSTOP (torchrun blames the healthy rank that timed out waiting for it),
and, where this machine lets a test make a memory cgroup, a rank the kernel OOM killer chose.
Every launch has a timeout; a launch that outlives its test is killed with its workers."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from rankmem.forensics.heartbeat import HeartbeatRecord, read_heartbeats
from rankmem.offline.events import read_events
from rankmem.probe import procfs as _procfs
from tests.cgroup_helpers import move_into, scratch_memory_cgroup
from tests.conftest import REPO

LAUNCH_TIMEOUT_S = 150  # --timeout-s of every launch; the test waits a little longer
ROOT_CAUSE = "Root Cause (first observed failure)"


@contextlib.contextmanager
def launch(out: Path, *args: str, prefix: tuple[str, ...] = ()) -> Iterator[subprocess.Popen[str]]:
    cmd = [*prefix, sys.executable, "-m", "rankmem", "train", "--nproc-per-node", "2", "--no-progress",
           "--out", str(out), "--timeout-s", str(LAUNCH_TIMEOUT_S), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:  # the test failed mid-launch: stop the launcher and every rank it ran
            for beat in read_heartbeats(str(out / "heartbeat")).values():
                with contextlib.suppress(OSError):
                    os.kill(beat.pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)


def wait_for(what: str, proc: subprocess.Popen[str], ready: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the launch ended (exit {proc.returncode}) before {what}\n{err[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def rank1_at_step(out: Path, step: int) -> Callable[[], bool]:
    def ready() -> bool:
        beat = read_heartbeats(str(out / "heartbeat")).get(1)
        return beat is not None and beat.step is not None and beat.step >= step
    return ready


def rank1(out: Path) -> HeartbeatRecord:
    return read_heartbeats(str(out / "heartbeat"))[1]


def freeze(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped: the signal is delivered asynchronously, so a heartbeat
    read straight after ``kill`` can predate the rank's last beat (it may still enter another phase)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            raise AssertionError(f"rank {pid} exited before SIGSTOP stopped it") from None
        if state in ("T", "t"):
            return
        assert time.monotonic() < deadline, f"rank {pid} did not stop within 10 s of SIGSTOP"
        time.sleep(0.005)


_LAST = re.compile(r"rankmem train: the job failed \(exit -?\d+\): (rank .*?)\. (?:torchrun's report|every step)")


def diagnosis(err: str) -> list[str]:
    """The launcher's findings: its own lines, and the one its last line ends the job with."""
    lines = [line for line in err.splitlines() if line.startswith("rankmem train: rank ")]
    last = _LAST.match(err.splitlines()[-1]) if err.strip() else None
    return lines + ([f"rankmem train: {last[1]}"] if last else [])


def torchrun_log(out: Path) -> str:
    """What torchrun and the ranks wrote, which the launcher keeps under OUT instead of the terminal."""
    return (out / "torchrun.log").read_text()


def test_sigkilled_rank_is_named_with_its_last_step(tmp_path: Path) -> None:
    with launch(tmp_path, "--task", "sft", "--steps", "2000") as proc:
        wait_for("rank 1's step 3", proc, rank1_at_step(tmp_path, 3))
        pid = rank1(tmp_path).pid
        freeze(pid)  # so the heartbeat read next is its last
        last = rank1(tmp_path)
        os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S + 30)
    assert proc.returncode not in (0, 124), err[-3000:]
    lines = diagnosis(err)
    assert lines == [f"rankmem train: rank 1 was killed by SIGKILL at step {last.step}, last RSS "
                     f"{last.rss_bytes / 2**30:.1f} GiB; cause unknown"], err[-3000:]
    # The diagnosis is the last line; torchrun's failure table is in the launch log, not on the terminal.
    assert err.splitlines()[-1].startswith("rankmem train: the job failed") and ROOT_CAUSE not in err
    assert ROOT_CAUSE in torchrun_log(tmp_path)
    (event,) = [e for e in read_events(str(tmp_path)).events if e.kind == "killed"]
    assert (event.rank, event.step, event.signal, event.pid) == (1, last.step, "SIGKILL", pid)
    assert (tmp_path / "events" / "rank1.jsonl").exists()


def _sigterm_pending(pid: int) -> bool:
    """torchrun has sent SIGTERM to the stopped ``pid`` (a process-directed signal: ShdPnd)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    mask = int(re.search(r"^ShdPnd:\s*([0-9a-f]+)", status, re.M)[1], 16)  # type: ignore[index]
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def test_stopped_rank_is_named_not_the_rank_that_timed_out(tmp_path: Path) -> None:
    pg_timeout = 6
    with launch(tmp_path, "--task", "grpo", "--steps", "2000", "--pg-timeout-s", str(pg_timeout)) as proc:
        wait_for("rank 1's step 2", proc, rank1_at_step(tmp_path, 2))
        pid = rank1(tmp_path).pid
        freeze(pid)
        last = rank1(tmp_path)
        # Rank 0 times out in its collective and fails; torchrun then SIGTERMs rank 1, which, stopped,
        # cannot act on it until continued (else torchrun waits 30 s and SIGKILLs it).
        wait_for("torchrun's SIGTERM to the stopped rank", proc, lambda: _sigterm_pending(pid), timeout=60)
        os.kill(pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S + 30)
    assert proc.returncode not in (0, 124), err[-3000:]
    assert "Timed out waiting" in torchrun_log(tmp_path)  # rank 0's gloo timeout: torchrun's root cause
    lines = diagnosis(err)
    assert len(lines) == 1, err[-3000:]
    line = lines[0]
    match = re.fullmatch(rf"rankmem train: rank 1 stopped making progress at step {last.step} "
                         rf"\(phase {last.phase}\): no heartbeat for (\d+) s; its process was stopped "
                         rf"\(state T: SIGSTOP or job control\)", line)
    assert match is not None, line
    assert int(match[1]) >= pg_timeout - 1
    assert ROOT_CAUSE not in err and ROOT_CAUSE in torchrun_log(tmp_path)
    (event,) = [e for e in read_events(str(tmp_path)).events if e.kind == "stalled"]
    assert (event.rank, event.step, event.phase, event.pid) == (1, last.step, last.phase, pid)


HOG = """
import os, sys, time
chunks = [bytearray(b"\\1") * (4 << 20) for _ in range(int(sys.argv[1]) // 4)]
print("allocated", flush=True)
time.sleep(60)
"""


def test_oom_killed_rank_is_blamed_on_the_oom_killer(tmp_path: Path) -> None:
    with scratch_memory_cgroup(64 << 30) as cgroup:
        enter = ("sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh")
        with launch(tmp_path, "--task", "sft", "--steps", "2000", prefix=enter) as proc:
            wait_for("rank 1's step 3", proc, rank1_at_step(tmp_path, 3))
            # The kernel picks the victim by oom_score: make it rank 1 (lowering another process's score
            # would need CAP_SYS_RESOURCE).
            Path(f"/proc/{rank1(tmp_path).pid}/oom_score_adj").write_text("1000")
            v1 = (cgroup / "memory.limit_in_bytes").exists()
            usage = int((cgroup / ("memory.usage_in_bytes" if v1 else "memory.current")).read_text())
            (cgroup / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(str(usage + (64 << 20)))
            # Enough that reclaiming the cgroup's page cache cannot make room for it, yet so little more
            # that rank 1's private memory (~150 MiB; the rest of its RSS is libraries shared with
            # rank 0) usually covers it. Where it does not, the kernel takes a second victim.
            stat = _procfs.parse_keyed((cgroup / "memory.stat").read_bytes())
            hog_mib = 64 + 32 + (_procfs.inactive_file(stat) or 0) // (1 << 20)
            hog = subprocess.Popen([sys.executable, "-c", f"import os; os.read(0, 1); exec({HOG!r})", str(hog_mib)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                move_into(cgroup, hog.pid)
                assert hog.stdin is not None
                hog.stdin.write("x")
                hog.stdin.flush()
                out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S + 30)
            finally:
                hog.kill()
                hog.communicate(timeout=30)
    assert proc.returncode not in (0, 124), err[-3000:]
    last = rank1(tmp_path)
    lines = diagnosis(err)
    # Where freeing rank 1 was not enough the kernel takes a second victim, named on its own line.
    assert f"rankmem train: rank 1 was killed by SIGKILL at step {last.step}, last RSS {last.rss_bytes / 2**30:.1f} " \
           "GiB; its cgroup's own OOM-kill count rose: the kernel OOM killer" in lines, err[-3000:]
    assert all(line.endswith("the kernel OOM killer") for line in lines), lines
    events = {e.rank: e for e in read_events(str(tmp_path)).events if e.kind == "killed"}
    assert events[1].cause == "oom_killer" and events[1].step == last.step
    assert events[1].cgroup_oom_kills[1] > events[1].cgroup_oom_kills[0]


def test_a_plain_sigkill_is_not_blamed_on_an_oom_kill_elsewhere_on_the_node(tmp_path: Path) -> None:
    """While rank 1 is SIGKILLed by hand, a memory cgroup the test makes beside the job OOM-kills a
    process of its own: the node's OOM-kill count rises, the job's cgroup's does not, and the diagnosis
    says what is known."""
    from tests.cgroup_helpers import oom_kills, run_in_cgroup

    with launch(tmp_path, "--task", "sft", "--steps", "2000") as proc:
        wait_for("rank 1's step 3", proc, rank1_at_step(tmp_path, 3))
        pid = rank1(tmp_path).pid
        freeze(pid)
        last = rank1(tmp_path)
        with scratch_memory_cgroup(64 << 20) as cgroup:
            _, status, _, _ = run_in_cgroup(cgroup, HOG, ["256"], env=dict(os.environ), timeout=60)
            assert status == -signal.SIGKILL and oom_kills(cgroup) >= 1, status
        os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S + 30)
    assert proc.returncode not in (0, 124), err[-3000:]
    assert diagnosis(err) == [f"rankmem train: rank 1 was killed by SIGKILL at step {last.step}, last RSS "
                              f"{last.rss_bytes / 2**30:.1f} GiB; cause unknown (an OOM kill happened elsewhere "
                              "on the node at that time)"], err[-3000:]
    (event,) = [e for e in read_events(str(tmp_path)).events if e.kind == "killed"]
    assert event.cause == "unknown" and event.node_oom_kills is not None
    assert event.node_oom_kills[1] > event.node_oom_kills[0], event.node_oom_kills
