"""Why a ``rankmem train`` job failed: the rank a signal killed, or the rank that stopped making progress.

torchrun's failure table names a "root cause" by the smallest failure timestamp, in whole seconds,
ties going to the lowest local rank: when rank 1 is SIGKILLed and rank 0 fails in the collective it
was waiting in, both fail in the same second and torchrun blames rank 0. So this module reads every
worker exit torchrun reports, keeps the signal deaths that torchrun did not cause itself (it sends
``SIGTERM``, then ``SIGKILL`` after a grace period, to the survivors of a failure, and logs each
one), and names them with their last step, phase and RSS from the ranks' heartbeat files. A rank
whose heartbeat sequence lags the others' and has gone stale is the one the others were waiting for.

Pure functions over text and records, so the tests feed them fixed torchrun output.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import Any

from rankmem._heartbeat import HeartbeatRecord
from rankmem._units import GIB

STALE_S = 5.0
"""A lagging rank is named only when its last beat is at least this old: ranks beat within
milliseconds of each other, so a lag of one beat between two fresh heartbeats is a race, not a hang."""

# torchrun >= 2.0, checked against 2.13: the agent's log line for the first failure, its notes of the
# signals it sends, and the failure table's per-worker lines.
_AGENT = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_SENT = re.compile(r"Sending process (\d+) closing signal (SIG[A-Z0-9]+)")
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
    signalled: set[int]
    """Pids torchrun itself sent a closing signal while shutting the job down."""


def parse_torchrun_output(text: str) -> TorchrunFailures:
    """The worker exits and the shutdown signals in torchrun's stderr."""
    exits: dict[int, WorkerExit] = {}
    signalled: set[int] = set()
    in_root = False
    pending: tuple[int, int] | None = None
    for line in text.splitlines():
        if match := _SENT.search(line):
            signalled.add(int(match[1]))
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
    event: dict[str, Any]


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
    # SIGTERM is torchrun's own closing signal: a SIGTERM death counts only as the root cause, in case
    # torchrun's warnings (which name the pids it signals) were filtered out of its log.
    deaths = [e for e in failures.exits if e.exitcode < 0 and e.pid not in failures.signalled
              and (e.exitcode != -signal.SIGTERM or e.root_cause)]
    findings = []
    for death in sorted(deaths, key=lambda e: not e.root_cause):
        beat = by_pid.get(death.pid)
        rank = beat.rank if beat is not None else death.rank
        if rank is None:
            continue  # neither a heartbeat nor the failure table says which rank this was
        sig = signal_name(death.exitcode)
        cause = "unknown"
        if death.exitcode == -signal.SIGKILL and _rose(before.cgroup, after.cgroup):
            cause, why = "oom_killer", "the cgroup's OOM-kill count rose: the kernel OOM killer"
        elif death.exitcode == -signal.SIGKILL and _rose(before.node, after.node):
            cause, why = "oom_killer", "the node's OOM-kill count rose: the kernel OOM killer"
        else:
            why = "cause unknown"
        rss = beat.rss_bytes if beat is not None else None
        line = f"rank {rank} was killed by {sig} {_where(beat)}"
        line += f", last RSS {rss / GIB:.1f} GiB; {why}" if rss is not None else f"; {why}"
        event = {"kind": "killed", "rank": rank, "step": beat.step if beat else None,
                 "phase": (beat.phase or None) if beat else None, "time": now, "pid": death.pid,
                 "signal": sig, "exitcode": death.exitcode, "cause": cause, "last_rss_bytes": rss,
                 "heartbeat_time": beat.time if beat else None,
                 "cgroup_oom_kills": [before.cgroup, after.cgroup], "node_oom_kills": [before.node, after.node],
                 "source": "launcher"}
        findings.append(Finding(rank, line, event))
    return findings


def stalled(heartbeats: dict[int, HeartbeatRecord], now: float, exclude: set[int],
            stale_s: float = STALE_S) -> Finding | None:
    """The rank that stopped making progress: every rank beats at the same window edges, so the one
    whose sequence counter lags the most (the oldest beat among equals) while its beat has gone stale
    is the one the others were waiting for. Ranks in ``exclude`` (already explained) are skipped."""
    live = [b for b in heartbeats.values() if not b.clean]
    if len(live) < 2:
        return None
    ahead = max(b.seq for b in live)
    behind = [b for b in live if b.seq < ahead and b.rank not in exclude and now - b.time >= stale_s]
    if not behind:
        return None
    beat = min(behind, key=lambda b: (b.seq, b.time))
    age = now - beat.time
    line = f"rank {beat.rank} stopped making progress {_where(beat)}: no heartbeat for {age:.0f} s"
    event = {"kind": "stalled", "rank": beat.rank, "step": beat.step, "phase": beat.phase or None, "time": now,
             "pid": beat.pid, "heartbeat_age_s": age, "heartbeat_seq": beat.seq, "ahead_seq": ahead,
             "last_rss_bytes": beat.rss_bytes, "source": "launcher"}
    return Finding(beat.rank, line, event)


def diagnose(torchrun_stderr: str, heartbeats: dict[int, HeartbeatRecord], before: OomKills,
             after: OomKills, now: float) -> list[Finding]:
    """Everything the launcher can say about a failed or stopped job: killed ranks, then a stalled one."""
    failures = parse_torchrun_output(torchrun_stderr)
    findings = killed(failures, heartbeats, before, after, now)
    # A rank that raised is explained by its own traceback, which torchrun shows; a stopped or hung
    # rank cannot raise (it ends by torchrun's signals), so it is never among these.
    raised = {e.pid for e in failures.exits if e.exitcode > 0}
    exclude = {f.rank for f in findings} | {b.rank for b in heartbeats.values() if b.pid in raised}
    stall = stalled(heartbeats, now, exclude)
    return findings + ([stall] if stall is not None else [])
