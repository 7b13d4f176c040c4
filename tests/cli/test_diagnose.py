"""The launcher's diagnosis on fixed torchrun 2.13 output and synthetic heartbeats: the killed rank that
torchrun may not blame, the OOM-kill counters, the stalled rank, and what is left to tracebacks."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from rankmem.cli._diagnose import OomKills, RankStates, diagnose, parse_torchrun_output
from rankmem.cli._train import StderrRelay
from rankmem.core.units import GIB
from rankmem.forensics.heartbeat import HeartbeatRecord

NOW = 1_000_000.0
LOG = "/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py"


def table(name: str, failures: list[tuple[int, int, int, str]], root: tuple[int, int, int, str]) -> str:
    """torchrun's ChildFailedError table: (rank, exitcode, pid, note) per failure, the root cause last."""

    def block(i: int, rank: int, code: int, pid: int, note: str) -> str:
        return (f"[{i}]:\n  time      : 2026-11-30_09:39:47\n  host      : localhost\n"
                f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code} (pid: {pid}){note}\n"
                f"  error_file: <N/A>\n  traceback : Signal {-code} received by PID {pid}\n")

    out = ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "=" * 54, f"{name} FAILED",
           "-" * 54, "Failures:"]
    out += [block(i + 1, *f) for i, f in enumerate(failures)] or ["  <NO_OTHER_FAILURES>"]
    out += ["-" * 54, "Root Cause (first observed failure):", block(0, *root), "=" * 54]
    return "\n".join(out) + "\n"


# Rank 1 (pid 9532) SIGKILLed from outside; torchrun then stops rank 0 with SIGTERM.
KILLED = (
    f"W1130 09:39:47.775000 9525 {LOG}:1028] Sending process 9531 closing signal SIGTERM\n"
    f"E1130 09:39:47.792000 9525 {LOG}:1002] failed (exitcode: -9) local_rank: 1 (pid: 9532) of binary: python\n"
    "Traceback (most recent call last):\n  File \"<frozen runpy>\", line 198, in _run_module_as_main\n"
    + table("rankmem.engine.train", [(0, -15, 9531, "  (SIGTERM)")], (1, -9, 9532, "  (SIGKILL)"))
)
# The same kill, but rank 0 failed in its collective within the same second: torchrun's timestamps are
# whole seconds, ties go to the lowest local rank, and rank 0 becomes the "root cause".
KILLED_BLAMING_RANK_0 = (
    f"E1130 09:39:47.792000 9525 {LOG}:1002] failed (exitcode: 1) local_rank: 0 (pid: 9531) of binary: python\n"
    + table("rankmem.engine.train", [(1, -9, 9532, "  (SIGKILL)")], (0, 1, 9531, " "))
)
# Rank 1 (pid 9904) SIGSTOPped: rank 0 times out in gloo and fails; torchrun SIGTERMs rank 1, which
# cannot act on it, and SIGKILLs it 30 s later.
STALLED = (
    "[rank0]: RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv\n"
    f"W1130 09:40:33.551000 9898 {LOG}:1028] Sending process 9904 closing signal SIGTERM\n"
    f"W1130 09:41:03.552000 9898 {LOG}:1047] Unable to shutdown process 9904 via 15, forcefully exiting via 9\n"
    f"E1130 09:41:03.585000 9898 {LOG}:1002] failed (exitcode: 1) local_rank: 0 (pid: 9903) of binary: python\n"
    + table("rankmem.engine.train", [(1, -9, 9904, "  (SIGKILL)")], (0, 1, 9903, " "))
)
NO_OOM = OomKills(cgroup=0, node=3)


def beat(rank: int, pid: int, step: int | None, phase: str = "", seq: int = 100, age: float = 0.5,
         rss: int | None = 3 * GIB, clean: bool = False) -> HeartbeatRecord:
    return HeartbeatRecord(pid=pid, rank=rank, step=step, phase=phase, rss_bytes=rss, time=NOW - age, seq=seq,
                           clean=clean)


def test_parse_torchrun_2_13_output() -> None:
    failures = parse_torchrun_output(KILLED)
    by_pid = {e.pid: e for e in failures.exits}
    assert set(by_pid) == {9531, 9532} and failures.signalled == {9531: {15}}
    assert (by_pid[9532].rank, by_pid[9532].exitcode, by_pid[9532].root_cause) == (1, -9, True)
    assert (by_pid[9531].rank, by_pid[9531].exitcode, by_pid[9531].root_cause) == (0, -15, False)
    stalled = parse_torchrun_output(STALLED)
    assert stalled.signalled == {9904: {15, 9}}
    assert parse_torchrun_output("").exits == []


def test_killed_rank_with_its_last_step_phase_and_rss() -> None:
    beats = {0: beat(0, 9531, 57, "update", seq=229), 1: beat(1, 9532, 57, "update", seq=228)}
    (finding,) = diagnose(KILLED, beats, NO_OOM, NO_OOM, NOW)
    assert finding.rank == 1
    assert finding.line == "rank 1 was killed by SIGKILL at step 57 (phase update), last RSS 3.0 GiB; cause unknown"
    e = finding.event
    assert (e.kind, e.rank, e.step, e.phase, e.signal, e.pid) == ("killed", 1, 57, "update", "SIGKILL", 9532)
    assert e.cause == "unknown" and e.last_rss_bytes == 3 * GIB and e.time == NOW


def test_oom_kill_counters_name_the_kernel_oom_killer() -> None:
    beats = {1: beat(1, 9532, 57, "update")}
    (cgroup,) = diagnose(KILLED, beats, OomKills(0, 3), OomKills(1, 4), NOW)
    assert cgroup.line.endswith("; its cgroup's own OOM-kill count rose: the kernel OOM killer")
    assert cgroup.event.cause == "oom_killer" and cgroup.event.cgroup_oom_kills == [0, 1]
    # The node's count names no one: a kill in another cgroup raises it too.
    for before in (OomKills(None, 3), OomKills(0, 3)):
        (node,) = diagnose(KILLED, beats, before, OomKills(before.cgroup, 4), NOW)
        assert node.line.endswith("; cause unknown (an OOM kill happened elsewhere on the node at that time)")
        assert node.event.cause == "unknown" and node.event.node_oom_kills == [3, 4]
    (unreadable,) = diagnose(KILLED, beats, OomKills(None, None), OomKills(None, None), NOW)
    assert unreadable.line.endswith("; cause unknown")


def test_killed_rank_named_even_when_torchrun_blames_another() -> None:
    beats = {0: beat(0, 9531, 12), 1: beat(1, 9532, 12)}
    (finding,) = diagnose(KILLED_BLAMING_RANK_0, beats, NO_OOM, NO_OOM, NOW)
    assert finding.line == "rank 1 was killed by SIGKILL at step 12, last RSS 3.0 GiB; cause unknown"


def test_killed_without_heartbeat_uses_torchrun_rank() -> None:
    (finding,) = diagnose(KILLED, {}, NO_OOM, NO_OOM, NOW)
    assert finding.line == "rank 1 was killed by SIGKILL before its first heartbeat; cause unknown"
    early = {1: beat(1, 9532, None, rss=None)}
    (finding,) = diagnose(KILLED, early, NO_OOM, NO_OOM, NOW)
    assert finding.line == "rank 1 was killed by SIGKILL before its first step; cause unknown"


def test_stale_heartbeat_of_a_stale_pid_is_not_used() -> None:
    beats = {1: beat(1, 777, 99, "rollout")}  # rank 1's file from another process
    (finding,) = diagnose(KILLED, beats, NO_OOM, NO_OOM, NOW)
    assert finding.line == "rank 1 was killed by SIGKILL before its first heartbeat; cause unknown"


def test_torchruns_sigterm_is_not_a_kill_even_unlogged() -> None:
    # LOGLEVEL=ERROR hides torchrun's "Sending process ... closing signal" warnings.
    unlogged = KILLED_BLAMING_RANK_0.replace("-9 (pid: 9532)", "-15 (pid: 9532)")
    assert "Sending process" not in unlogged
    assert diagnose(unlogged, {}, NO_OOM, NO_OOM, NOW) == []
    # An outside SIGTERM that torchrun saw first is still named.
    external = KILLED.replace("-9", "-15").replace("Sending process 9531", "Sending process 1")
    (finding,) = diagnose(external, {}, NO_OOM, NO_OOM, NOW)
    assert finding.line == "rank 1 was killed by SIGTERM before its first heartbeat; cause unknown"


def test_two_ranks_killed_while_torchrun_was_stopping_one() -> None:
    # The OOM killer took rank 1 and then rank 0; torchrun, seeing rank 0 gone, sent SIGTERM to rank 1,
    # which was already dying of SIGKILL: not torchrun's signal, so rank 1 is named too.
    text = (f"W1130 09:52:44.503000 16647 {LOG}:1028] Sending process 16661 closing signal SIGTERM\n"
            f"E1130 09:52:44.527000 16647 {LOG}:1002] failed (exitcode: -9) local_rank: 0 (pid: 16660) of binary: p\n"
            + table("rankmem.engine.train", [(1, -9, 16661, "  (SIGKILL)")], (0, -9, 16660, "  (SIGKILL)")))
    beats = {0: beat(0, 16660, 4, rss=GIB // 2), 1: beat(1, 16661, 4)}
    found = diagnose(text, beats, OomKills(0, 0), OomKills(2, 2), NOW)
    assert [f.line for f in found] == [
        "rank 0 was killed by SIGKILL at step 4, last RSS 0.5 GiB; its cgroup's own OOM-kill count rose: the kernel "
        "OOM killer",
        "rank 1 was killed by SIGKILL at step 4, last RSS 3.0 GiB; its cgroup's own OOM-kill count rose: the kernel "
        "OOM killer",
    ]


def test_other_signals() -> None:
    segv = KILLED.replace("exitcode: -9", "exitcode: -11").replace("-9 (pid", "-11 (pid")
    (finding,) = diagnose(segv, {1: beat(1, 9532, 3, rss=None)}, OomKills(0, 0), OomKills(1, 1), NOW)
    assert finding.line == "rank 1 was killed by SIGSEGV at step 3; cause unknown"  # the OOM killer sends SIGKILL


def test_stalled_rank_named_instead_of_the_rank_torchrun_blames() -> None:
    beats = {0: beat(0, 9903, 161, "update", seq=486, age=31.0), 1: beat(1, 9904, 161, "log_prob", seq=485, age=40.2)}
    (finding,) = diagnose(STALLED, beats, NO_OOM, NO_OOM, NOW)
    assert finding.line == "rank 1 stopped making progress at step 161 (phase log_prob): no heartbeat for 40 s"
    e = finding.event
    assert (e.kind, e.rank, e.step, e.phase, e.pid) == ("stalled", 1, 161, "log_prob", 9904)
    assert e.heartbeat_age_s == pytest.approx(40.2) and e.heartbeat_seq == 485 and e.ahead_seq == 486


def test_stopped_process_named_when_both_ranks_beat_the_same_edge() -> None:
    # Rank 1 froze just after beating "update"; rank 0 beat "update" too and waits in its collective:
    # equal sequences, and rank 0's beat may even be the older. Only the process state tells.
    beats = {0: beat(0, 9903, 161, "update", seq=486, age=41.0), 1: beat(1, 9904, 161, "update", seq=486, age=40.0)}
    assert diagnose(STALLED, beats, NO_OOM, NO_OOM, NOW) == []
    (finding,) = diagnose(STALLED, beats, NO_OOM, NO_OOM, NOW, states={0: "S", 1: "T"})
    assert finding.line == ("rank 1 stopped making progress at step 161 (phase update): no heartbeat for 40 s; "
                            "its process was stopped (state T: SIGSTOP or job control)")
    assert finding.event.process_state == "T"
    (finding,) = diagnose("", beats, NO_OOM, NO_OOM, NOW, states={0: "S", 1: "D"})
    assert finding.line.endswith("; its process was in uninterruptible sleep (state D: waiting in the kernel, "
                                 "e.g. on I/O or a driver)")
    # A stop that is still fresh (a debugger pausing a rank for a moment) is not a stall.
    fresh = {0: beat(0, 9903, 1, seq=4), 1: beat(1, 9904, 1, seq=4, age=1.0)}
    assert diagnose("", fresh, NO_OOM, NO_OOM, NOW, states={1: "T"}) == []


def test_rank_states_read_only_the_launched_job(tmp_path: Path) -> None:
    def proc_file(pid: int, name: str, text: str) -> None:
        path = tmp_path / str(pid) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    proc_file(100, "task/100/children", "101 102")  # torchrun with its two ranks
    proc_file(101, "stat", "101 (python) S 100")
    proc_file(102, "stat", "102 (python) T 100")
    proc_file(555, "stat", "555 (other) T 1")  # a pid named by another node's heartbeat
    beats = {0: beat(0, 101, 3), 1: beat(1, 102, 3), 2: beat(2, 555, 3)}
    states = RankStates(str(tmp_path))
    states.sample(100, beats)
    assert states.last == {0: "S", 1: "T"}
    (tmp_path / "102" / "stat").unlink()  # rank 1 gone: its last state is kept
    states.sample(100, beats)
    assert states.last == {0: "S", 1: "T"}
    # Rank 1 continued only to act on torchrun's SIGTERM: running, but its heartbeat has not moved since
    # it was seen stopped, so it is still the stopped rank; once it beats again, it is running.
    proc_file(102, "stat", "102 (python) R 100")
    states.sample(100, beats)
    assert states.last == {0: "S", 1: "T"}
    states.sample(100, {**beats, 1: beat(1, 102, 4, seq=beats[1].seq + 1)})
    assert states.last == {0: "S", 1: "R"}
    # Rank 0 passed through D (a driver call) and now waits in a collective, beatless: it is waiting,
    # not in D for good (only a stop is kept while the heartbeat stands still).
    proc_file(101, "stat", "101 (python) D 100")
    states.sample(100, beats)
    proc_file(101, "stat", "101 (python) S 100")
    states.sample(100, beats)
    assert states.last[0] == "S"


def test_stall_on_the_launchers_own_timeout_without_torchrun_output() -> None:
    beats = {0: beat(0, 1, 12, "update", seq=40, age=25), 1: beat(1, 2, 12, "rollout", seq=37, age=26),
             2: beat(2, 3, 12, "update", seq=40, age=25)}
    (finding,) = diagnose("", beats, NO_OOM, NO_OOM, NOW)
    assert finding.line == "rank 1 stopped making progress at step 12 (phase rollout): no heartbeat for 26 s"


def test_no_stall_without_a_lagging_stale_rank() -> None:
    # Equal sequences: every rank is stuck at the same edge (nobody is behind).
    assert diagnose("", {0: beat(0, 1, 5, seq=9, age=60), 1: beat(1, 2, 5, seq=9, age=60)}, NO_OOM, NO_OOM, NOW) == []
    # Behind by one beat, but fresh: a race between two live ranks, not a hang.
    assert diagnose("", {0: beat(0, 1, 5, seq=9), 1: beat(1, 2, 5, seq=8)}, NO_OOM, NO_OOM, NOW) == []
    # One rank only, or ranks that exited cleanly.
    assert diagnose("", {0: beat(0, 1, 5, seq=1, age=60)}, NO_OOM, NO_OOM, NOW) == []
    assert diagnose("", {0: beat(0, 1, 5, seq=9, clean=True), 1: beat(1, 2, 5, seq=1, age=60, clean=True)},
                    NO_OOM, NO_OOM, NOW) == []


def test_a_rank_that_raised_is_left_to_its_traceback() -> None:
    # Rank 1 raised at step 3 (exit 1); its heartbeat lags and has aged while torchrun shut down.
    text = (f"W1130 09:39:47.775000 9525 {LOG}:1028] Sending process 9531 closing signal SIGTERM\n"
            f"E1130 09:39:47.792000 9525 {LOG}:1002] failed (exitcode: 1) local_rank: 1 (pid: 9532) of binary: p\n"
            + table("rankmem.engine.train", [(0, -15, 9531, "  (SIGTERM)")], (1, 1, 9532, " ")))
    beats = {0: beat(0, 9531, 3, seq=10, age=6), 1: beat(1, 9532, 3, seq=9, age=7)}
    assert diagnose(text, beats, NO_OOM, NO_OOM, NOW) == []


def test_relay_holds_the_failure_table_until_released() -> None:
    r, w = os.pipe()
    sink = io.StringIO()
    with os.fdopen(r, "rb") as source:
        relay = StderrRelay(source, sink)
        os.write(w, b"[rank0]: step 1\n" + KILLED.encode())
        os.close(w)
        relay.wait(5)
        shown = sink.getvalue()
        assert "Sending process 9531" in shown and "failed (exitcode" not in shown and "Root Cause" not in shown
        assert "Root Cause (first observed failure):" in relay.text()
        sink.write("rankmem train: rank 1 was killed\n")
        relay.release()
    out = sink.getvalue()
    assert out.index("rankmem train: rank 1 was killed") < out.index("failed (exitcode: -9)") < out.index("Root Cause")


def test_relay_that_fails_on_a_line_warns_once_and_keeps_draining(monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay's thread is a failure boundary (rankmem.core.guard): torchrun must never block on a full pipe."""
    real = StderrRelay._take

    def take(self: StderrRelay, raw: bytes) -> None:
        if raw.startswith(b"bad"):
            raise UnicodeError("a line the relay cannot take")
        real(self, raw)

    monkeypatch.setattr(StderrRelay, "_take", take)
    r, w = os.pipe()
    sink = io.StringIO()
    with pytest.warns(RuntimeWarning) as caught, os.fdopen(r, "rb") as source:
        relay = StderrRelay(source, sink)
        os.write(w, b"one\nbad 1\ntwo\nbad 2\nthree\n")
        os.close(w)
        relay.wait(5)
    assert sink.getvalue() == "one\ntwo\nthree\n"
    assert [str(w.message) for w in caught] == [
        "rankmem: a line of torchrun's stderr could not be relayed (the launch log lacks it): "
        "UnicodeError('a line the relay cannot take')"]
