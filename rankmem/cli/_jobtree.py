"""Stopping all of a job ``rankmem train`` started (torchrun, every rank, their children) when the
command is asked to stop (:class:`SignalWatch`), or when ranks outlive torchrun (:class:`JobTree`).

Signalling torchrun's process group is not enough: torchrun starts each worker in a session of its own
(``start_new_session``), and a worker whose torchrun died is reparented to PID 1, out of reach of a
walk from torchrun. So the launcher remembers every process it has seen below torchrun (walked through
``/proc/PID/task/TID/children`` while the job runs, see :func:`rankmem.probe.procfs.descendants`), and each
rank's own pid from its heartbeat (:mod:`rankmem.forensics.heartbeat`) once that process is shown to be one of
this job's (below torchrun, or carrying this job's ``RANKMEM_HEARTBEAT_DIR``). A process is identified by
its pid and start time, so a pid the kernel has since given to an unrelated process is never signalled.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from rankmem.probe import procfs as _procfs

POLL_S = 0.05  # while waiting for the tree to exit
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class JobTree:
    """Every process of one launched job, by pid and start time."""

    def __init__(self, root_pid: int, env_mark: str | None = None, proc: str = "/proc") -> None:
        """``env_mark``: a ``NAME=value`` every rank's environment holds (its heartbeat directory), the
        proof of membership for a rank no longer below ``root_pid``."""
        self.root = root_pid
        self._mark = env_mark.encode() if env_mark else None
        self._proc = proc
        self._seen: dict[int, int] = {}  # pid -> start time (clock ticks after boot)
        self.refresh()

    def refresh(self, rank_pids: Iterable[int] = ()) -> None:
        """Remember the processes below the root now, and those of ``rank_pids`` that are this job's."""
        below = {self.root} | _procfs.descendants(self.root, self._proc)
        for pid in below:
            self._remember(pid)
        for pid in rank_pids:
            if pid not in self._seen and self._marked(pid):
                self._remember(pid)
                for child in _procfs.descendants(pid, self._proc):
                    self._remember(child)

    def _remember(self, pid: int) -> None:
        if pid not in self._seen:
            started = self._start_time(pid)
            if started is not None:
                self._seen[pid] = started

    def _start_time(self, pid: int) -> int | None:
        try:
            with open(f"{self._proc}/{pid}/stat", "rb") as f:
                data = f.read()
        except OSError:
            return None
        if _procfs.parse_stat_state(data) == "Z":  # exited, waiting to be reaped: nothing left to stop
            return None
        return _procfs.parse_stat_starttime(data)

    def _marked(self, pid: int) -> bool:
        if self._mark is None:
            return False
        try:
            with open(f"{self._proc}/{pid}/environ", "rb") as f:
                return self._mark in f.read().split(b"\0")
        except OSError:
            return False

    def alive(self) -> list[int]:
        """The remembered processes still running (the same pid with the same start time)."""
        return [pid for pid, started in self._seen.items() if self._start_time(pid) == started]

    def signal(self, sig: int) -> list[int]:
        """Send ``sig`` to every live process of the job; returns the pids signalled."""
        self.refresh()
        sent = []
        for pid in self.alive():
            try:
                os.kill(pid, sig)
                sent.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        return sent

    def stop(self, sig: int, grace_s: float, reap: Callable[[], object] = lambda: None,
             hurry: Callable[[], bool] = lambda: False) -> list[int]:
        """``sig`` to every process, up to ``grace_s`` for them to exit (less when ``hurry()`` turns
        true: a second signal), then SIGKILL to those left. ``reap`` is called while waiting (the
        launcher's ``Popen.poll``: torchrun is its child and must be reaped to be gone). Returns the
        pids that needed SIGKILL."""
        self.signal(sig)
        if self._wait(grace_s, reap, hurry):
            return []
        killed = self.signal(signal.SIGKILL)
        self._wait(5.0, reap, lambda: False)  # SIGKILL cannot be caught: only a process in state D lingers
        return killed

    def _wait(self, timeout_s: float, reap: Callable[[], object], hurry: Callable[[], bool]) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            reap()
            if not self.alive():
                return True
            if time.monotonic() >= deadline or hurry():
                return False
            time.sleep(POLL_S)


class Signalled(Exception):  # noqa: N818 - it is no error: the command was asked to stop
    """A forwarded signal arrived: the job is stopped and the command exits with 128 + its number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SignalWatch:
    """While armed, the first of SIGTERM, SIGHUP, SIGINT raises :class:`Signalled` in the main thread;
    one that comes before :meth:`arm` waits for it (torchrun is not yet known), and later ones only
    make :meth:`hurry` true (a second Ctrl-C: no grace period)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._armed = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalWatch:
        if threading.current_thread() is threading.main_thread():  # signal.signal() works there alone
            for sig in FORWARDED_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        if self._armed and len(self.received) == 1:
            raise Signalled(signum)

    def arm(self) -> None:
        self._armed = True
        if self.received:
            raise Signalled(self.received[0])

    def disarm(self) -> None:
        self._armed = False

    def hurry(self) -> bool:
        return len(self.received) > 1

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
