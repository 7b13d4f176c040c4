"""Why a ``rankmem train`` job failed: the rank a signal killed, or the rank that stopped making progress.

torchrun's failure table names a "root cause" by the smallest failure timestamp, in whole seconds,
ties going to the lowest local rank: when rank 1 is SIGKILLed and rank 0 fails in the collective it
was waiting in, both fail in the same second and torchrun blames rank 0. So this module reads every
worker exit torchrun reports and keeps the deaths by a signal that torchrun did not send that worker
itself (it sends ``SIGTERM``, then ``SIGKILL`` after a grace period, to the survivors of a failure,
and logs each), and names those ranks with their last step, phase and RSS from their heartbeat
files. A rank whose heartbeat sequence lags the others' and has gone stale is the one the others
were waiting for.

The diagnosis is pure functions over text and records, so the tests feed them fixed torchrun output;
:class:`RankStates` is the one part that reads ``/proc``, while the job runs.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from rankmem.core.events import KilledEvent, StalledEvent
from rankmem.core.units import GIB
from rankmem.forensics.heartbeat import HeartbeatRecord
from rankmem.probe import procfs as _procfs

STALE_S = 5.0
"""A lagging rank is named only when its last beat is at least this old: ranks beat within
milliseconds of each other, so a lag of one beat between two fresh heartbeats is a race, not a hang."""

# torchrun >= 2.0, checked against 2.13: the agent's log line for the first failure, its notes of the
# signals it sends, and the failure table's per-worker lines.
_AGENT = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_SENT = re.compile(r"Sending process (\d+) closing signal (SIG[A-Z0-9]+)")
_ESCALATED = re.compile(r"Unable to shutdown process (\d+) via \d+, forcefully exiting via (\d+)")
_RANK = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank: (\d+)\)")
_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)")
_ROOT = "Root Cause (first observed failure)"


@dataclass(frozen=True, slots=True)
class WorkerExit:
    """One failed worker as torchrun reports it."""

    pid: int
    exitcode: int
    """The exit status; ``-N`` for death by signal ``N``."""
    rank: int | None
    local_rank: int | None
    root_cause: bool
    """torchrun called it the first observed failure (see the module docstring for why that can mislead)."""


@dataclass(frozen=True, slots=True)
class TorchrunFailures:
    exits: list[WorkerExit]
    signalled: dict[int, set[int]]
    """The signals (numbers) torchrun itself sent each pid while shutting the job down."""


def parse_torchrun_output(text: str) -> TorchrunFailures:
    """The worker exits and the shutdown signals in torchrun's stderr."""
    exits: dict[int, WorkerExit] = {}
    signalled: dict[int, set[int]] = {}
    in_root = False
    pending: tuple[int, int] | None = None
    for line in text.splitlines():
        if match := _SENT.search(line):
            sig = getattr(signal.Signals, match[2], None)
            if sig is not None:
                signalled.setdefault(int(match[1]), set()).add(int(sig))
        elif match := _ESCALATED.search(line):
            signalled.setdefault(int(match[1]), set()).add(int(match[2]))
        elif match := _AGENT.search(line):
            pid = int(match[3])
            exits.setdefault(pid, WorkerExit(pid, int(match[1]), None, int(match[2]), root_cause=False))
        elif _ROOT in line:
            in_root = True
        elif line.strip().startswith("Failures:"):
            in_root = False
        elif match := _RANK.match(line):
            pending = (int(match[1]), int(match[2]))
        elif match := _EXIT.match(line):
            pid = int(match[2])
            rank, local = pending if pending is not None else (None, None)
            exits[pid] = WorkerExit(pid, int(match[1]), rank, local, root_cause=in_root)
            pending = None
    return TorchrunFailures(list(exits.values()), signalled)


def signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


@dataclass(frozen=True, slots=True)
class OomKills:
    """OOM-kill counters (None: unreadable) of the launcher's memory cgroup and of the node."""

    cgroup: int | None
    node: int | None


@dataclass(frozen=True, slots=True)
class Finding:
    """One diagnosis: the line to print and the event to write into ``events/rank<rank>.jsonl``."""

    rank: int
    line: str
    event: KilledEvent | StalledEvent


def _where(beat: HeartbeatRecord | None) -> str:
    if beat is None:
        return "before its first heartbeat"
    if beat.step is None:
        return "before its first step"
    return f"at step {beat.step}" + (f" (phase {beat.phase})" if beat.phase else "")


def _rose(before: int | None, after: int | None) -> bool:
    return before is not None and after is not None and after > before


def killed(failures: TorchrunFailures, heartbeats: dict[int, HeartbeatRecord], before: OomKills,
           after: OomKills, now: float) -> list[Finding]:
    """The workers a signal killed that torchrun did not send, torchrun's root cause first."""
    by_pid = {b.pid: b for b in heartbeats.values()}
    # A worker that died of a signal torchrun had not sent it (SIGKILL while torchrun had sent only
    # SIGTERM: the OOM killer got there first) was killed from outside. SIGTERM is torchrun's own
    # closing signal: a SIGTERM death counts only as the root cause, in case torchrun's warnings (which
    # name the pids it signals) were filtered out of its log.
    deaths = [e for e in failures.exits if e.exitcode < 0 and -e.exitcode not in failures.signalled.get(e.pid, ())
              and (e.exitcode != -signal.SIGTERM or e.root_cause)]
    findings = []
    for death in sorted(deaths, key=lambda e: not e.root_cause):
        beat = by_pid.get(death.pid)
        rank = beat.rank if beat is not None else death.rank
        if rank is None:
            continue  # neither a heartbeat nor the failure table says which rank this was
        sig = signal_name(death.exitcode)
        cause, why = "unknown", "cause unknown"
        # Only the rank's own cgroup's count names the kernel OOM killer: the node's counts a kill in any
        # cgroup (another job's, a test's), which says nothing of who killed this rank.
        if death.exitcode == -signal.SIGKILL and _rose(before.cgroup, after.cgroup):
            cause, why = "oom_killer", "its cgroup's own OOM-kill count rose: the kernel OOM killer"
        elif death.exitcode == -signal.SIGKILL and _rose(before.node, after.node):
            why = "cause unknown (an OOM kill happened elsewhere on the node at that time)"
        rss = beat.rss_bytes if beat is not None else None
        line = f"rank {rank} was killed by {sig} {_where(beat)}"
        line += f", last RSS {rss / GIB:.1f} GiB; {why}" if rss is not None else f"; {why}"
        event = KilledEvent(rank=rank, step=beat.step if beat else None,
                            phase=(beat.phase or None) if beat else None, time=now, pid=death.pid,
                            signal=sig, exitcode=death.exitcode, cause=cause, last_rss_bytes=rss,
                            heartbeat_time=beat.time if beat else None,
                            cgroup_oom_kills=[before.cgroup, after.cgroup], node_oom_kills=[before.node, after.node],
                            source="launcher")
        findings.append(Finding(rank, line, event))
    return findings


# Scheduler states (field 3 of /proc/PID/stat) of a process that cannot be making progress.
STUCK_STATES = {
    "T": "its process was stopped (state T: SIGSTOP or job control)",
    "t": "its process was stopped by a debugger (state t)",
    "D": "its process was in uninterruptible sleep (state D: waiting in the kernel, e.g. on I/O or a driver)",
}
STOPPED = ("T", "t")


class RankStates:
    """The scheduler state of each local rank process, sampled by the launcher while the job runs.

    A rank frozen by SIGSTOP and a rank waiting in a collective for it both stop beating; only the process
    state, read while the processes live, tells them apart. The launcher samples once a second, and reads
    only descendants of the launched torchrun (a shared heartbeat directory may name other nodes' pids).
    """

    def __init__(self, proc: str = "/proc") -> None:
        self._proc = proc
        self.last: dict[int, str] = {}
        """Rank -> its state at the last sample that found its process alive."""
        self._stopped_at: dict[int, tuple[int, int]] = {}  # rank -> (pid, heartbeat seq) when last seen stopped

    def sample(self, root_pid: int, heartbeats: dict[int, HeartbeatRecord]) -> None:
        local = _procfs.descendants(root_pid, self._proc)
        for beat in heartbeats.values():
            if beat.pid not in local:
                continue
            try:
                with open(f"{self._proc}/{beat.pid}/stat", "rb") as f:
                    state = _procfs.parse_stat_state(f.read())
            except OSError:
                continue
            # A dying process passes through Z (zombie) and X: keep what it was doing while alive, or a
            # rank stopped until torchrun killed it would read as merely dead. Likewise a stopped rank
            # continued only to act on torchrun's SIGTERM runs for a moment without beating again: while
            # its heartbeat has not moved, it is still the rank that was stopped. Only a stop is kept so:
            # a healthy rank passes through D (I/O, a driver call) and then waits, beatless, for the hung one.
            if state is None or state in ("Z", "X"):
                continue
            if state in STOPPED:
                self._stopped_at[beat.rank] = (beat.pid, beat.seq)
            elif self._stopped_at.get(beat.rank) == (beat.pid, beat.seq):
                continue
            else:
                self._stopped_at.pop(beat.rank, None)
            self.last[beat.rank] = state


def stalled(heartbeats: dict[int, HeartbeatRecord], now: float, exclude: set[int],
            states: dict[int, str] | None = None, stale_s: float = STALE_S) -> Finding | None:
    """The rank that stopped making progress, among those whose heartbeat has gone stale: one whose
    process was last seen stopped (``states``, see :class:`RankStates`), else the one whose sequence
    counter lags the most (every rank beats at the same window edges; the oldest beat among equals).
    Ranks in ``exclude`` (already explained) are skipped."""
    states = states or {}
    live = [b for b in heartbeats.values() if not b.clean and b.rank not in exclude]
    stale = [b for b in live if now - b.time >= stale_s]
    stuck = [b for b in stale if states.get(b.rank) in STUCK_STATES]
    # Progress is collect edges first, then window edges: a rank that stopped after its step window
    # closed and before collect() beat last at the same edge as one waiting inside the collect, but the
    # waiting one has entered it (issue 20).
    ahead = max((b.progress for b in heartbeats.values() if not b.clean), default=(0, 0))
    behind = [b for b in stale if b.progress < ahead]
    if not stuck and not behind:
        return None
    beat = min(stuck or behind, key=lambda b: (b.progress, b.time))
    age = now - beat.time
    state = states.get(beat.rank)
    line = f"rank {beat.rank} stopped making progress {_where(beat)}: no heartbeat for {age:.0f} s"
    if state in STUCK_STATES:
        line += f"; {STUCK_STATES[state]}"
    event = StalledEvent(rank=beat.rank, step=beat.step, phase=beat.phase or None, time=now,
                         pid=beat.pid, heartbeat_age_s=age, heartbeat_seq=beat.seq, ahead_seq=ahead[1],
                         collect_marks=beat.marks, ahead_marks=ahead[0],
                         process_state=state, last_rss_bytes=beat.rss_bytes, source="launcher")
    return Finding(beat.rank, line, event)


def diagnose(torchrun_stderr: str, heartbeats: dict[int, HeartbeatRecord], before: OomKills,
             after: OomKills, now: float, states: dict[int, str] | None = None) -> list[Finding]:
    """Everything the launcher can say about a failed or stopped job: killed ranks, then a stalled one."""
    failures = parse_torchrun_output(torchrun_stderr)
    findings = killed(failures, heartbeats, before, after, now)
    # A rank that raised is explained by its own traceback, which torchrun shows; a stopped or hung
    # rank cannot raise (it ends by torchrun's signals), so it is never among these.
    raised = {e.pid for e in failures.exits if e.exitcode > 0}
    exclude = {f.rank for f in findings} | {b.rank for b in heartbeats.values() if b.pid in raised}
    stall = stalled(heartbeats, now, exclude, states)
    return findings + ([stall] if stall is not None else [])
