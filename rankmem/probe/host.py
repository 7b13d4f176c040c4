"""Host memory of this process, its children and its node.

On Linux every per-step read is an ``os.pread`` on a descriptor opened once (a few microseconds);
elsewhere psutil is the fallback. The implementation is chosen once, by :func:`make_host_probe`.
The children's private memory is read on a thread of its own (:mod:`rankmem.probe.children`).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Protocol

from rankmem.core.cadence import Every
from rankmem.core.guard import attempt
from rankmem.core.records import HostReading
from rankmem.core.warnings import WarnOnce
from rankmem.probe import procfs as _procfs
from rankmem.probe.children import ChildrenUss

_STATUS_BUF = 4096  # /proc/self/status is ~1.4 KB; VmHWM sits in its first half
_MEMINFO_BUF = 8192

_forks = 0
"""Forks into this process since rankmem was imported: a child's ``os.register_at_fork`` hook counts
them, and the window edge compares the count instead of calling ``getpid()`` (a fork that bypasses
``os.fork``, a C library's own, is caught by :meth:`LinuxHostProbe.read`'s pid check)."""


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


class LinuxHostProbe:
    """Reads ``/proc`` and cgroup files through descriptors kept open for the life of the probe.

    Children: the descendant list is rebuilt from ``/proc/PID/task/*/children`` at most every
    ``children_refresh_s`` seconds; each known child's ``statm`` is read through a cached descriptor on
    every call, and their USS summed at the same cadence on a daemon thread (:class:`ChildrenUss`).
    """

    def __init__(self, children: bool = True, children_refresh_s: float = 5.0, proc: str = "/proc",
                 reset_peaks: bool = True) -> None:
        self._proc = proc
        self._reset_peaks = reset_peaks
        self._last_hwm = 0  # peak_source="edges": the VmHWM seen at the last edge
        self._pid = os.getpid()
        self._forks = _forks
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._children_enabled = children
        self._children_refresh_s = children_refresh_s
        self._children_statm = _ChildrenStatm(self._descendants, children_refresh_s, proc)
        self._children_uss: ChildrenUss | None = None
        self._warn_once = WarnOnce()
        # read() runs on the node thread, and on the training thread where an OOM event or the first
        # collect reads for itself: the children's descriptors are closed as children exit, once.
        self._read_lock = threading.Lock()
        self._open()

    def _open(self) -> None:
        me = f"{self._proc}/{self._pid}"
        self._statm = _procfs.open_ro(f"{me}/statm")
        self._status = _procfs.open_ro(f"{me}/status")
        self._meminfo = _procfs.open_ro(f"{self._proc}/meminfo")
        self._clear_refs: int | None = None
        if not self._reset_peaks:
            # peak_source="edges": VmHWM stays the process's true lifetime peak, for getrusage, a parent's
            # wait4, /usr/bin/time -v and anything polling VmHWM (docs/peak-source.md).
            self.peak_is_lifetime = True
        else:
            self._open_clear_refs(me)
        try:
            with open(f"{me}/cgroup") as f:
                files = _procfs.find_cgroup_files(f.read())
        except OSError:
            files = None
        self._cgroup = _procfs.CgroupReader(files) if files is not None else None

    def _open_clear_refs(self, me: str) -> None:
        try:
            # Writing "5" resets VmHWM to the current RSS (Linux >= 4.0). Opening does not reset; the
            # first reset_peak() that fails marks the peak as a lifetime peak.
            self._clear_refs = os.open(f"{me}/clear_refs", os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            self._clear_refs = None
        self.peak_is_lifetime = self._clear_refs is None
        if self.peak_is_lifetime:
            self._lifetime_warning()

    def check_fork(self) -> None:
        # Descriptors opened on /proc/PID follow the PID, not the caller: a forked child must reopen.
        if os.getpid() != self._pid:
            self.close()
            self._pid = os.getpid()
            self._children_statm.expire()
            self._open()
        self._forks = _forks  # after the reopen: until then the edge keeps coming here

    def rss(self) -> int | None:
        data = _procfs.pread(self._statm, 256)
        return None if data is None else _procfs.parse_statm_rss(data, self._page)

    def peak_rss(self) -> int | None:
        """Max RSS since the last :meth:`reset_peak` (``VmHWM``)."""
        return self.rss_and_peak()[1]

    @property
    def peak_scope(self) -> str:
        """``window`` when VmHWM resets at each window edge, ``lifetime`` where it cannot, ``edges`` where
        rankmem leaves it alone (``peak_source="edges"``)."""
        if not self._reset_peaks:
            return "edges"
        return "lifetime" if self.peak_is_lifetime else "window"

    def rss_and_peak(self) -> tuple[int | None, int | None]:
        """Current RSS and the peak since the last reset from one read of ``status`` (``VmRSS``,
        ``VmHWM``): the kernel formats the whole file on every read (~5 us), so read it once."""
        data = _procfs.pread(self._status, _STATUS_BUF)
        if data is None:
            return self.rss(), None
        rss, hwm = _procfs.parse_status_rss_hwm(data)
        return (rss if rss is not None else self.rss()), hwm

    def edge(self) -> tuple[int | None, int | None]:
        """The window-edge read: current RSS and the peak since the last edge, then the peak reset.
        Every step's hot path: the reads of :meth:`rss_and_peak` and :meth:`reset_peak` inline."""
        if _forks != self._forks:  # a number compared, not getpid(): a system call, cold on every edge
            self.check_fork()
        data = b""
        if self._status is not None:
            try:
                data = os.pread(self._status, _STATUS_BUF, 0)
            except OSError:
                pass
        found = _procfs.status_hwm_rss(data)  # the read's whole parse, in one call
        rss: int | None
        peak: int | None
        if found is not None:
            rss, peak = int(found[2]) << 10, int(found[1]) << 10
        else:
            rss, peak = _procfs.parse_status_rss_hwm(data)
            if rss is None:
                rss = self.rss()
        if not self._reset_peaks:
            # Never reset, VmHWM only says something of this window where it rose since the last edge:
            # then the window reached exactly it. Otherwise the window's peak is its edges' RSS (a floor).
            if peak is None or peak <= self._last_hwm:
                return rss, None
            self._last_hwm = peak
            return rss, peak
        if self._clear_refs is not None:
            try:
                os.write(self._clear_refs, b"5")
            except OSError:
                self._reset_failed()
        return rss, peak

    def reset_peak(self) -> None:
        if self._clear_refs is not None:
            try:
                os.write(self._clear_refs, b"5")
            except OSError:
                self._reset_failed()

    def _reset_failed(self) -> None:
        _procfs.close_fd(self._clear_refs)
        self._clear_refs = None
        self.peak_is_lifetime = True
        self._lifetime_warning()

    def _lifetime_warning(self) -> None:
        self._warn_once("clear_refs", "cannot reset VmHWM (/proc/self/clear_refs); peak RSS is a lifetime peak")

    def children_rss(self) -> int | None:
        return self._children_statm.total(self._page) if self._children_enabled else None

    def children_uss(self) -> int | None:
        """Summed private memory of the descendants, as last read by the refresh thread."""
        if not self._children_enabled:
            return None
        if self._children_uss is None:
            self._children_uss = ChildrenUss(self._descendants, self._children_refresh_s, self._proc)
        return self._children_uss.value()

    def _descendants(self) -> set[int]:
        if not os.path.exists(f"{self._proc}/{self._pid}/task/{self._pid}/children"):
            # Kernels without CONFIG_PROC_CHILDREN: psutil's scan of all of /proc (~0.7 ms), still
            # only once per refresh interval.
            import psutil

            try:
                found = {p.pid for p in psutil.Process(self._pid).children(recursive=True)}
            except psutil.Error:
                return set()
        else:
            found = _procfs.descendants(self._pid, self._proc)
        return found

    def node(self) -> tuple[int | None, int | None]:
        data = _procfs.pread(self._meminfo, _MEMINFO_BUF)
        if data is None:
            return None, None
        total, available = _procfs.parse_meminfo(data)
        if available is None:
            self._warn_once("MemAvailable",
                            "/proc/meminfo has no MemAvailable (Linux < 3.14); node available unavailable")
        return total, available

    def cgroup(self) -> tuple[int | None, int | None, int | None]:
        """``(used, limit, working set)``, all ``None`` when no memory limit applies."""
        return self._cgroup.read() if self._cgroup is not None else (None, None, None)

    def read(self, process: bool = True) -> HostReading:
        """Every figure, node, cgroup and children included; without ``process`` (a collect, right after
        the window's closing edge read them) this process's RSS and peak are left ``None``."""
        with self._read_lock:
            self.check_fork()
            return read_host(self, process)

    def close(self) -> None:
        if self._children_uss is not None:
            self._children_uss.close()
            self._children_uss = None
        if self._cgroup is not None:
            self._cgroup.close()
            self._cgroup = None
        for fd in [self._statm, self._status, self._meminfo, self._clear_refs]:
            _procfs.close_fd(fd)
        self._children_statm.close()
        self._statm = self._status = self._meminfo = self._clear_refs = None


class _ChildrenStatm:
    """The descendants' ``statm`` through cached descriptors: the list of descendants rebuilt at most every
    ``refresh_s`` seconds, each known child's statm read on every call."""

    def __init__(self, descendants: Callable[[], set[int]], refresh_s: float, proc: str) -> None:
        self._descendants, self._proc = descendants, proc
        self._fds: dict[int, int] = {}
        self._due = Every(refresh_s)

    def expire(self) -> None:
        self._due.expire()

    def total(self, page: int) -> int:
        if self._due.due():
            self._refresh()
        total = 0
        for pid, fd in list(self._fds.items()):
            data = _procfs.pread(fd, 256)
            rss = None if not data else _procfs.parse_statm_rss(data, page)
            if rss is None:  # the child exited: its statm reads ESRCH or nothing
                if self._fds.pop(pid, None) == fd:
                    os.close(fd)
                continue
            total += rss
        return total

    def _refresh(self) -> None:
        pids = self._descendants()
        for gone in set(self._fds) - pids:
            fd = self._fds.pop(gone, None)
            if fd is not None:
                os.close(fd)
        for pid in pids - set(self._fds):
            fd = _procfs.open_ro(f"{self._proc}/{pid}/statm")
            if fd is not None:
                self._fds[pid] = fd

    def close(self) -> None:
        for fd in self._fds.values():
            _procfs.close_fd(fd)
        self._fds.clear()


class PsutilHostProbe:
    """Off Linux: psutil. The window peak is our own max of the RSS read at window edges ("sampled")."""

    def __init__(self, children: bool = True, children_refresh_s: float = 5.0) -> None:
        import psutil

        self._psutil = psutil
        self._proc = psutil.Process()
        self._children_enabled = children
        self._children: list[psutil.Process] = []
        self._children_due = Every(children_refresh_s)
        self.peak_is_lifetime = True
        self.peak_scope = "sampled"
        self._peak: int | None = None

    def rss(self) -> int | None:
        return attempt(lambda: int(self._proc.memory_info().rss), default=None)

    def peak_rss(self) -> int | None:
        """Our own max of the RSS seen at window edges (``sampled``): psutil has no resettable
        high-water mark, and Windows' ``peak_wset`` is a lifetime one."""
        rss = self.rss()
        if rss is not None:
            self._peak = rss if self._peak is None else max(self._peak, rss)
        return self._peak

    def rss_and_peak(self) -> tuple[int | None, int | None]:
        return self.rss(), self.peak_rss()

    def reset_peak(self) -> None:
        self._peak = None

    def edge(self) -> tuple[int | None, int | None]:
        rss = self.rss()
        if rss is not None:
            self._peak = rss if self._peak is None else max(self._peak, rss)
        peak, self._peak = self._peak, None
        return rss, peak

    def children_rss(self) -> int | None:
        if not self._children_enabled:
            return None
        if self._children_due.due():
            self._children = attempt(self._proc.children, recursive=True, default=[])
        # A child that exited since the refresh counts 0.
        return sum(attempt(lambda c=child: int(c.memory_info().rss), default=0) for child in self._children)

    def children_uss(self) -> int | None:
        return None  # smaps_rollup is Linux-only; psutil's USS walks every mapping on the caller's thread

    def node(self) -> tuple[int | None, int | None]:
        vm = self._psutil.virtual_memory()
        return int(vm.total), int(vm.available)

    def cgroup(self) -> tuple[int | None, int | None, int | None]:
        return None, None, None  # cgroups are Linux-only

    def read(self, process: bool = True) -> HostReading:
        # Always read in full: peak_rss() folds the RSS it reads into the sampled peak, and a collect's
        # read is part of what the sampled peak has always seen.
        return read_host(self)

    def check_fork(self) -> None:
        pass  # psutil.Process() follows no descriptors

    def close(self) -> None:
        self._children = []


class HostProbe(Protocol):
    """What the windows need from a host probe; tests and other platforms pass their own through
    ``Monitor(host_probe=...)``."""

    @property
    def peak_scope(self) -> str:
        """``window``, ``lifetime`` (the kernel cannot reset the peak) or ``sampled`` (edge reads only)."""
        ...

    def edge(self) -> tuple[int | None, int | None]:
        """At a window edge (a few microseconds): current RSS and the peak since the previous edge,
        then reset that peak."""
        ...

    def read(self, process: bool = True) -> HostReading:
        """Every host figure now (node, cgroup and children included). A collect passes
        ``process=False``: its window's closing edge has just read this process's RSS and peak, which
        a probe may then leave ``None``."""
        ...

    def close(self) -> None: ...


class _Figures(Protocol):
    """The per-figure reads both platform probes have, which :func:`read_host` assembles."""

    peak_is_lifetime: bool

    def rss(self) -> int | None: ...
    def peak_rss(self) -> int | None: ...
    def children_rss(self) -> int | None: ...
    def children_uss(self) -> int | None: ...
    def node(self) -> tuple[int | None, int | None]: ...
    def cgroup(self) -> tuple[int | None, int | None, int | None]: ...


def read_host(probe: _Figures, process: bool = True) -> HostReading:
    """Every host figure of ``probe`` at one instant; without ``process``, RSS and peak are ``None``."""
    total, available = probe.node()
    cg_used, cg_limit, cg_working = probe.cgroup()
    return HostReading(
        rss=probe.rss() if process else None,
        peak_rss=probe.peak_rss() if process else None,
        peak_rss_is_lifetime=probe.peak_is_lifetime,
        children_rss=probe.children_rss(),
        node_total=total,
        node_available=available,
        cgroup_used=cg_used,
        cgroup_limit=cg_limit,
        children_uss=probe.children_uss(),
        cgroup_working_set=cg_working,
    )


PEAK_SOURCES = ("window", "edges")
PEAK_SOURCE_ENV = "RANKMEM_PEAK_SOURCE"


def peak_source_default() -> str:
    """``$RANKMEM_PEAK_SOURCE`` where set (a job's environment can choose without a code change), else
    ``window``."""
    return os.environ.get(PEAK_SOURCE_ENV, "").strip() or "window"


def make_host_probe(children: bool = True, children_refresh_s: float = 5.0, reset_peaks: bool = True) -> HostProbe:
    """The host probe for this platform, chosen once. ``reset_peaks=False``: never write
    ``/proc/self/clear_refs`` (``peak_source="edges"``)."""
    if sys.platform.startswith("linux") and os.path.exists(f"/proc/{os.getpid()}/statm"):
        return LinuxHostProbe(children=children, children_refresh_s=children_refresh_s, reset_peaks=reset_peaks)
    return PsutilHostProbe(children=children, children_refresh_s=children_refresh_s)
