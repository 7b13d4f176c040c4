"""Which PID the GPU driver knows a process by: host and container PIDs joined through ``/proc``.

NVML reports PIDs of the host's PID namespace. Inside a container with its own, ``os.getpid()`` is
another number, and a lookup of it silently misses. What ``/proc`` can tell, in order:

- in the initial PID namespace (``/proc/self/ns/pid`` is ``PROC_PID_INIT_INO``) PIDs are the host's;
- ``NSpid`` in ``/proc/<pid>/status`` with more than one entry: ``/proc`` belongs to an ancestor
  namespace and its first entry is the PID there;
- otherwise the host PID is invisible: unless the driver translates PIDs (checked by
  :mod:`rankmem.probe.attribution`), the PIDs are *not mapped*, and that is said, never guessed.

A descendant found through ``/proc`` maps as the process that found it does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from rankmem.probe import procfs as _procfs

INIT_PID_NS = 0xEFFFFFFC
"""``PROC_PID_INIT_INO`` (include/linux/proc_ns.h): the inode of the initial PID namespace, fixed."""

HOST_NAMESPACE = "host PID namespace"
NSPID = "NSpid (host /proc visible)"
NOT_MAPPED = "host PIDs not mapped"


def parse_nspid(status: bytes) -> list[int] | None:
    """The ``NSpid:`` line of ``/proc/PID/status`` as PIDs, outermost first; None where absent."""
    for line in status.splitlines():
        if line.startswith(b"NSpid:"):
            try:
                pids = [int(tok) for tok in line.split()[1:]]
            except ValueError:
                return None
            return pids or None
    return None


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(8192)
    except OSError:  # the process exited, or /proc hides it
        return None


@dataclass(frozen=True, slots=True)
class PidView:
    """How this process's ``/proc`` relates to the driver's PID namespace."""

    method: str
    """:data:`HOST_NAMESPACE`, :data:`NSPID` or :data:`NOT_MAPPED`."""
    own_pid: int
    """``os.getpid()``: this process in its own namespace."""
    proc_pid: int | None
    """This process in ``/proc``'s namespace (where ``/proc`` lists its children)."""
    host_pid: int | None
    """This process in the host's namespace, where ``/proc`` shows it; None: not mapped."""
    proc: str = "/proc"

    @property
    def mapped(self) -> bool:
        return self.host_pid is not None

    def host_pid_of(self, proc_pid: int) -> int | None:
        """The host PID of a process ``/proc`` lists as ``proc_pid``; None where not mapped or gone."""
        if not self.mapped:
            return None
        if self.method == HOST_NAMESPACE:
            return proc_pid
        nspid = parse_nspid(_read(f"{self.proc}/{proc_pid}/status") or b"")
        return None if nspid is None else nspid[0]

    def descendants(self) -> set[int]:
        """This process's descendants as ``/proc`` lists them (its namespace's PIDs)."""
        if self.proc_pid is None:
            return set()
        return _procfs.descendants(self.proc_pid, self.proc)


def pid_namespace_inode(proc: str = "/proc") -> int | None:
    """The inode of this process's PID namespace (``pid:[4026531836]``); None where unreadable."""
    try:
        link = os.readlink(f"{proc}/self/ns/pid")
    except OSError:
        return None
    try:
        return int(link.rsplit("[", 1)[1].rstrip("]"))
    except (IndexError, ValueError):
        return None


def pid_view(proc: str = "/proc") -> PidView:
    """This process's :class:`PidView`, read now (three small reads of ``/proc/self``)."""
    own = os.getpid()
    try:
        proc_pid: int | None = int(os.readlink(f"{proc}/self"))
    except (OSError, ValueError):
        proc_pid = None
    if pid_namespace_inode(proc) == INIT_PID_NS:
        return PidView(HOST_NAMESPACE, own, proc_pid if proc_pid is not None else own, own, proc)
    nspid = parse_nspid(_read(f"{proc}/self/status") or b"")
    if nspid is not None and len(nspid) > 1:
        return PidView(NSPID, own, nspid[0], nspid[0], proc)
    return PidView(NOT_MAPPED, own, proc_pid, None, proc)
