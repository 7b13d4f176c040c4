"""Ray integration: a Monitor inside a Ray actor, and Ray's own processes kept out of the children figure.

In each actor of your worker group, after the actor has joined its ``torch.distributed`` group::

    from rankmem.integrations.ray import actor_monitor
    monitor = actor_monitor(out_dir="/shared/runs/exp1")  # every actor; rank 0 writes the run log

Rank and world size come from the process group; ``LOCAL_RANK`` goes into the run log header beside each
rank's host. Node figures are aggregated by max/min/mean, never summed, so actors sharing a node do not
double-count them.

Children: a process that started a local Ray cluster is the ancestor of Ray's daemons and workers, which
would read as dataloader workers holding gigabytes. :class:`RayAwareHostProbe` leaves out every process
Ray titles ``ray::...`` or runs from the ``ray`` package, and everything below them; your own workers
still count. :func:`ray_charged_bytes` reads the USS that Ray's memory monitor weighs a worker by, to put
beside ``mem/host/rss_gib``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

from rankmem.core.cadence import Every
from rankmem.core.records import HostReading
from rankmem.errors import RankmemError
from rankmem.monitor import Monitor
from rankmem.probe import procfs as _procfs
from rankmem.probe.host import HostProbe, make_host_probe, peak_source_default

__all__ = ["RayAwareHostProbe", "actor_monitor", "is_ray_process", "ray_charged_bytes"]

RAY_TITLE = "ray::"
"""The process title Ray gives its workers (``ray::IDLE``, ``ray::MyActor``) and agents."""


def _ray_package_dir() -> str | None:
    # find_spec does not import ray (it would cost ~0.4 s in every process that builds a probe).
    spec = importlib.util.find_spec("ray")
    if spec is None or spec.origin is None:
        return None
    return os.path.dirname(spec.origin) + os.sep


def is_ray_process(cmdline: list[str], ray_dir: str | None) -> bool:
    """Whether a process with this command line is one of Ray's own: a worker or agent (titled
    ``ray::...``), or a program in the ``ray`` package (``raylet``, ``gcs_server``, Ray's Python helpers
    ``python -u .../ray/_private/log_monitor.py``)."""
    if not cmdline:
        return False
    if cmdline[0].startswith(RAY_TITLE):
        return True
    return ray_dir is not None and any(arg.startswith(ray_dir) for arg in cmdline[:3])


class RayAwareHostProbe:
    """The platform's host probe with a children figure that leaves Ray's processes out.

    Every figure but ``children_rss`` comes from the wrapped probe unchanged. The descendant list is
    rebuilt at most every ``children_refresh_s`` seconds from one pass over the process table (a few
    ms; Ray's processes and their subtrees pruned); each kept child's RSS is read on every ``read``.
    """

    def __init__(self, children: bool = True, children_refresh_s: float = 5.0, reset_peaks: bool = True) -> None:
        import psutil

        self._psutil = psutil
        self._inner: HostProbe = make_host_probe(children=False, reset_peaks=reset_peaks)
        self._children_enabled = children
        self._children: list[Any] = []  # psutil.Process
        self._children_due = Every(children_refresh_s)
        self._ray_dir = _ray_package_dir()
        self.ray_processes_left_out = 0
        """How many of this process's descendants the last refresh found to be Ray's (subtrees counted once)."""

    @property
    def peak_scope(self) -> str:
        return self._inner.peak_scope

    def edge(self) -> tuple[int | None, int | None]:
        return self._inner.edge()

    def read(self, process: bool = True) -> HostReading:
        return dataclasses.replace(self._inner.read(process), children_rss=self.children_rss())

    def children_rss(self) -> int | None:
        if not self._children_enabled:
            return None
        if self._children_due.due():
            self._children = self._own_descendants()
        total = 0
        for child in self._children:
            try:
                total += int(child.memory_info().rss)
            except self._psutil.Error:  # exited since the refresh
                continue
        return total

    def _own_descendants(self) -> list[Any]:
        psutil = self._psutil
        kids: dict[int, list[int]] = {}
        for p in psutil.process_iter(["ppid"]):
            ppid = p.info.get("ppid")
            if ppid is not None:
                kids.setdefault(ppid, []).append(p.pid)
        found: list[Any] = []
        left_out = 0
        frontier = list(kids.get(os.getpid(), []))
        while frontier:
            pid = frontier.pop()
            try:
                proc = psutil.Process(pid)
                cmdline = proc.cmdline()
            except psutil.Error:
                continue
            if is_ray_process(cmdline, self._ray_dir):
                left_out += 1  # and not its subtree: a raylet's children are Ray workers
                continue
            found.append(proc)
            frontier.extend(kids.get(pid, []))
        self.ray_processes_left_out = left_out
        return found

    def close(self) -> None:
        self._children = []
        self._inner.close()


def actor_monitor(*, out_dir: str | None = None, group: Any = None, **options: Any) -> Monitor:
    """A :class:`rankmem.Monitor` for this Ray actor's rank, with :class:`RayAwareHostProbe`.

    Call it in every actor of the group after ``torch.distributed.init_process_group``; ``out_dir`` must be
    a path every actor can reach. Other keyword options are :class:`rankmem.MonitorConfig` fields.
    """
    import torch.distributed as dist

    if group is None and not (dist.is_available() and dist.is_initialized()):
        raise RankmemError("actor_monitor() needs this actor's process group: call "
                           "torch.distributed.init_process_group first (the Monitor's rank and world size are the "
                           "group's)")
    probe = RayAwareHostProbe(children=options.get("children", True),
                              children_refresh_s=options.get("children_refresh_s", 5.0),
                              reset_peaks=options.get("peak_source", peak_source_default()) == "window")
    return Monitor(out_dir=out_dir, group=group, host_probe=probe, **options)


_USS_FIELDS = (b"Private_Clean", b"Private_Dirty", b"Private_Hugetlb")


def ray_charged_bytes(pid: int | None = None) -> int | None:
    """The memory Ray's memory monitor charges process ``pid`` (default: this one) when it picks a
    worker to kill: its USS, the ``Private_*`` fields of ``/proc/PID/smaps_rollup`` summed (Ray 2.60,
    ``MemoryMonitorUtils::GetLinuxProcessMemoryBytesFromSmap``). ``None`` off Linux (before 4.14)."""
    try:
        with open(f"/proc/{pid if pid is not None else os.getpid()}/smaps_rollup", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = [_procfs.parse_kb_field(data, name) for name in _USS_FIELDS]
    return sum(v for v in fields if v is not None) if any(v is not None for v in fields) else None
