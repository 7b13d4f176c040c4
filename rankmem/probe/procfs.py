"""Parsers for Linux ``/proc`` and cgroup files, fed bytes so tests can give them fixed text.

Every parser returns bytes (or ``None`` for a field the kernel did not give); none raises on odd input.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

_KB = 1024
# cgroup v1 reports "no limit" as PAGE_COUNTER_MAX rounded to pages, e.g. 9223372036854771712;
# anything this large is no limit at all.
_UNLIMITED = 1 << 62


def parse_statm_rss(data: bytes, page_size: int) -> int | None:
    """RSS in bytes from ``/proc/PID/statm`` (``size resident shared text lib data dt``, in pages)."""
    fields = data.split()
    if len(fields) < 2:
        return None
    try:
        return int(fields[1]) * page_size
    except ValueError:
        return None


def parse_kb_field(data: bytes, name: bytes) -> int | None:
    """A ``Name:  123 kB`` field of ``/proc/PID/status`` or ``/proc/meminfo``, in bytes."""
    start = data.find(b"\n" + name + b":")
    if start < 0:
        if not data.startswith(name + b":"):
            return None
        start = 0
    else:
        start += 1
    end = data.find(b"\n", start)
    line = data[start : end if end >= 0 else len(data)]
    parts = line.split()
    if len(parts) < 2:
        return None
    try:
        value = int(parts[1])
    except ValueError:
        return None
    unit = parts[2].lower() if len(parts) > 2 else b""
    return value * _KB if unit == b"kb" else value


def parse_status_rss_hwm(data: bytes) -> tuple[int | None, int | None]:
    """``(VmRSS, VmHWM)`` in bytes from ``/proc/PID/status``: the per-step hot path, so one scan.

    Kernel threads and zombies have neither field; both are then ``None``.
    """
    found = status_hwm_rss(data)
    if found is not None:
        return int(found[2]) * _KB, int(found[1]) * _KB
    return _kb_after(data, b"\nVmRSS:"), _kb_after(data, b"\nVmHWM:")  # one of them, or another order


status_hwm_rss = re.compile(rb"\nVmHWM:\s*(\d+) kB\nVmRSS:\s*(\d+) kB").search
"""Both fields in one search, in Linux's order (``task_mem``): the window edge's whole parse."""


def _kb_after(data: bytes, tag: bytes) -> int | None:
    start = data.find(tag)
    if start < 0:
        return None
    start += len(tag)
    end = data.find(b" kB", start)
    if end < 0 or end - start > 32:
        return None
    try:
        return int(data[start:end]) * _KB  # int() skips the tab and padding
    except ValueError:
        return None


def parse_meminfo(data: bytes) -> tuple[int | None, int | None]:
    """``(MemTotal, MemAvailable)`` in bytes. ``MemAvailable`` is missing before Linux 3.14."""
    return parse_kb_field(data, b"MemTotal"), parse_kb_field(data, b"MemAvailable")


def parse_cgroup_limit(data: bytes) -> int | None:
    """``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1): ``None`` for ``max`` or an unlimited value."""
    text = data.strip()
    if not text or text == b"max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def parse_int(data: bytes) -> int | None:
    try:
        return int(data.strip())
    except ValueError:
        return None


def parse_children(data: bytes) -> list[int]:
    """Child PIDs from ``/proc/PID/task/TID/children`` (space separated)."""
    pids = []
    for tok in data.split():
        try:
            pids.append(int(tok))
        except ValueError:
            continue
    return pids


def parse_keyed(data: bytes) -> dict[str, int]:
    """``key value`` lines as a dict of ints: cgroup v2 ``memory.events`` and ``memory.stat``, v1
    ``memory.stat`` and ``memory.oom_control``, ``/proc/vmstat``. Lines that are not ``key int`` are skipped."""
    out: dict[str, int] = {}
    for line in data.splitlines():
        parts = line.split()
        if len(parts) != 2:
            continue
        try:
            out[parts[0].decode("ascii", "replace")] = int(parts[1])
        except ValueError:
            continue
    return out


def parse_uss(smaps_rollup: bytes) -> int | None:
    """Private memory (USS) in bytes from ``/proc/PID/smaps_rollup`` (Linux >= 4.14): ``Private_Clean +
    Private_Dirty``, what the process would give back if it exited."""
    clean = parse_kb_field(smaps_rollup, b"Private_Clean")
    dirty = parse_kb_field(smaps_rollup, b"Private_Dirty")
    return None if clean is None or dirty is None else clean + dirty


def descendants(pid: int, proc: str = "/proc") -> set[int]:
    """Every descendant of ``pid``, walked through ``/proc/PID/task/TID/children`` (Linux >= 3.5 with
    ``CONFIG_PROC_CHILDREN``; ~100 us per process, against ~0.7 ms for psutil's scan of all of /proc).
    Empty where the kernel lacks those files."""
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for path in glob.glob(f"{proc}/{parent}/task/*/children"):
            try:
                with open(path, "rb") as f:
                    kids = parse_children(f.read())
            except OSError:
                continue
            for kid in kids:
                if kid not in found:
                    found.add(kid)
                    frontier.append(kid)
    return found


def parse_stat_state(data: bytes) -> str | None:
    """The scheduler state letter (``R``, ``S``, ``D``, ``T``, ``t``, ``Z``...) of ``/proc/PID/stat``, field 3."""
    end = data.rfind(b")")
    fields = data[end + 1 :].split() if end >= 0 else []
    return fields[0].decode("ascii", "replace") if fields else None


def parse_stat_starttime(data: bytes) -> int | None:
    """Start time of a process in clock ticks after boot: field 22 of ``/proc/PID/stat``. The command
    name (field 2) may hold spaces and parentheses, so fields are counted after its last ``)``."""
    end = data.rfind(b")")
    if end < 0:
        return None
    fields = data[end + 1 :].split()
    try:
        return int(fields[19])  # field 3 is fields[0]
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class PsiLine:
    """One line of a pressure-stall file: the share of wall time (percent) in which tasks stalled on
    memory, averaged over 10, 60 and 300 s, and the total stall time in microseconds."""

    avg10: float
    avg60: float
    avg300: float
    total_us: int


@dataclass(frozen=True, slots=True)
class Pressure:
    """``/proc/pressure/memory`` or cgroup v2 ``memory.pressure`` (Linux >= 4.20, ``CONFIG_PSI``).

    ``some``: at least one task stalled; ``full``: every non-idle task stalled at once."""

    some: PsiLine | None
    full: PsiLine | None


def parse_pressure(data: bytes) -> Pressure | None:
    """``some avg10=0.12 avg60=0.05 avg300=0.00 total=12345`` and its ``full`` line; ``None`` when
    neither line parses."""
    lines: dict[bytes, PsiLine] = {}
    for line in data.splitlines():
        parts = line.split()
        if len(parts) < 5 or parts[0] not in (b"some", b"full"):
            continue
        fields = dict(p.split(b"=", 1) for p in parts[1:] if b"=" in p)
        try:
            lines[parts[0]] = PsiLine(float(fields[b"avg10"]), float(fields[b"avg60"]),
                                      float(fields[b"avg300"]), int(fields[b"total"]))
        except (KeyError, ValueError):
            continue
    if not lines:
        return None
    return Pressure(lines.get(b"some"), lines.get(b"full"))


def inactive_file(stat: dict[str, int]) -> int | None:
    """Reclaimable file cache from a parsed ``memory.stat``: v1's hierarchical ``total_inactive_file``
    where present (it includes child cgroups, as ``usage_in_bytes`` does), else ``inactive_file`` (v2
    is hierarchical already)."""
    return stat.get("total_inactive_file", stat.get("inactive_file"))


def working_set(usage: int, stat: bytes) -> int | None:
    """What the OOM killer weighs in a memory cgroup: ``usage`` (v2 ``memory.current``, v1
    ``memory.usage_in_bytes``) minus the inactive file cache of its ``memory.stat``, clamped at 0, as
    kubelet and Ray compute it: inactive page cache is reclaimed before anything is killed. ``None``
    when ``memory.stat`` has no inactive-file figure."""
    inactive = inactive_file(parse_keyed(stat))
    return None if inactive is None else max(usage - inactive, 0)


@dataclass(frozen=True, slots=True)
class CgroupFiles:
    """Where this process's cgroup memory accounting lives."""

    version: int
    dir: str
    """The cgroup's directory: the other memory files (events, stat, pressure) sit beside these two."""
    current: str
    """``memory.current`` (v2) or ``memory.usage_in_bytes`` (v1)."""
    limit: str
    """``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1)."""


def find_cgroup_files(proc_self_cgroup: str, root: str = "/sys/fs/cgroup", tightest: bool = True
                      ) -> CgroupFiles | None:
    """Locate the memory files of the cgroup named in ``/proc/self/cgroup``; v2 first, then v1.

    Inside a cgroup namespace the path is ``/``, so the mount root is tried after the full path.
    ``tightest``: the cgroup from this one up to the mount root with the smallest limit (a Slurm step or a
    systemd slice is often limited while the task's own cgroup says ``max``). ``False``: this process's own.
    """
    files = _own_cgroup_files(proc_self_cgroup, root)
    return _tightest(files, root) if files is not None and tightest else files


def _tightest(files: CgroupFiles, root: str) -> CgroupFiles:
    """``files``, or the files of the ancestor (up to the hierarchy's mount) with the smallest limit."""
    limited = [(limit, c) for c in limited_cgroups(files, root) if (limit := _read_limit(c.limit)) is not None]
    return min(limited, key=lambda lc: lc[0])[1] if limited else files


def limited_cgroups(files: CgroupFiles, root: str) -> list[CgroupFiles]:
    """``files`` and each ancestor up to the hierarchy's mount that has a memory limit now, innermost
    first: any of them can be the one whose limit the OOM killer enforces."""
    mount = os.path.normpath(root if files.version == 2 else os.path.join(root, "memory"))
    current_name, limit_name = os.path.basename(files.current), os.path.basename(files.limit)
    found = [files]
    directory = os.path.normpath(files.dir)
    while directory != mount and directory.startswith(mount + os.sep):
        directory = os.path.dirname(directory)
        current, limit = os.path.join(directory, current_name), os.path.join(directory, limit_name)
        if _read_limit(limit) is not None and os.path.isfile(current):
            found.append(CgroupFiles(files.version, directory, current, limit))
    return found


class CgroupReader:
    """One cgroup's usage, limit and ``memory.stat``, kept open for repeated reads (the host probe's
    collect, the near-OOM watch's polls)."""

    STAT_BUF = 8192  # v1 memory.stat is ~1.3 KB, v2 ~1.5 KB

    def __init__(self, files: CgroupFiles) -> None:
        self.files = files
        self._usage = open_ro(files.current)
        self._limit = open_ro(files.limit)
        self._stat = open_ro(os.path.join(files.dir, "memory.stat"))

    def read(self) -> tuple[int | None, int | None, int | None]:
        """``(used, limit, working set)`` in bytes; all None while no limit applies, the working set
        None where ``memory.stat`` cannot be read."""
        data = pread(self._limit, 64)
        limit = None if data is None else parse_cgroup_limit(data)
        if limit is None:
            return None, None, None
        data = pread(self._usage, 64)
        used = None if data is None else parse_int(data)
        stat = pread(self._stat, self.STAT_BUF)
        return used, limit, None if used is None or stat is None else working_set(used, stat)

    def close(self) -> None:
        for fd in (self._usage, self._limit, self._stat):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._usage = self._limit = self._stat = None


def _read_limit(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            return parse_cgroup_limit(f.read(64))
    except OSError:
        return None


def _own_cgroup_files(proc_self_cgroup: str, root: str) -> CgroupFiles | None:
    v2_path: str | None = None
    v1_path: str | None = None
    for line in proc_self_cgroup.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    candidates: list[tuple[int, str, str, str]] = []
    if v2_path is not None:
        for base in (os.path.join(root, v2_path.lstrip("/")), root):
            candidates.append((2, base, "memory.current", "memory.max"))
    if v1_path is not None:
        mount = os.path.join(root, "memory")
        for base in (os.path.join(mount, v1_path.lstrip("/")), mount):
            candidates.append((1, base, "memory.usage_in_bytes", "memory.limit_in_bytes"))
    for version, base, current, limit in candidates:
        cur, lim = os.path.join(base, current), os.path.join(base, limit)
        if os.path.isfile(cur) and os.path.isfile(lim):
            return CgroupFiles(version, base, cur, lim)
    return None


def own_cgroup_files(proc: str = "/proc", root: str = "/sys/fs/cgroup", tightest: bool = True
                     ) -> CgroupFiles | None:
    """:func:`find_cgroup_files` for this process (``PROC/self/cgroup``); ``None`` when unreadable."""
    try:
        with open(os.path.join(proc, "self", "cgroup")) as f:
            text = f.read()
    except OSError:
        return None
    return find_cgroup_files(text, root, tightest)


def open_ro(path: str) -> int | None:
    """A descriptor kept open for repeated ``pread`` (a few microseconds a read); None if it cannot open."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def pread(fd: int | None, size: int) -> bytes | None:
    """The first ``size`` bytes of the file behind ``fd``; None when closed or unreadable (a child that
    exited, EOPNOTSUPP from /proc/pressure/memory when booted with psi=0)."""
    if fd is None:
        return None
    try:
        return os.pread(fd, size, 0)
    except OSError:
        return None


def close_fd(fd: int | None) -> None:
    """Close ``fd`` if open, ignoring errors: closing is the last thing a probe or writer does."""
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
