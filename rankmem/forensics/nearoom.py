"""Host near-OOM watch: a table of every rank's memory *before* the kernel OOM killer acts.

The OOM killer's victim gets SIGKILL and runs no code, so the evidence must be taken while it still
can be. A daemon thread (one per node is enough, e.g. the lowest local rank) polls cheap sources
every ``interval_s`` through descriptors opened once (``os.pread``): the cgroup's usage, limit and
``memory.stat`` (v2 ``memory.current``/``memory.max``, v1 ``memory.usage_in_bytes``/
``memory.limit_in_bytes``), ``/proc/meminfo`` and memory pressure (PSI). When headroom falls under
the threshold or pressure crosses one, it calls ``on_near_oom(info)`` once per episode, with the
figures and a per-node table of every rank process and its children (pid, rank, RSS, step, phase; private
memory only where it decides which process holds the most), the ranks found through their heartbeat files. Cost:
``bench/bench_nearoom.py``.

Headroom in a cgroup is ``limit - working set``, the working set being usage minus inactive file
cache (as kubelet and Ray compute it): page cache fills a cgroup up to its limit and is reclaimed
before anything is killed, so plain usage would cry wolf on every job that reads its data set.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rankmem.core.events import NearOomEvent
from rankmem.core.guard import Guard
from rankmem.errors import RankmemError
from rankmem.forensics.heartbeat import HeartbeatRecord, read_heartbeats
from rankmem.probe import procfs as _procfs

__all__ = ["NearOomConfig", "NearOomWatch", "largest_private", "node_oom_kill_count", "oom_kill_count",
           "process_table"]

_MEMINFO = 8192
_STAT = 8192  # v1 memory.stat is ~1.3 KB, v2 ~1.5 KB


def _read(path: str, size: int = _STAT) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError:
        return None


@dataclass
class NearOomConfig:
    """When the near-OOM watch fires."""

    interval_s: float = 0.2
    """Seconds between polls; each poll costs a few reads (~50 us)."""
    headroom_fraction: float = 0.05
    """Fire when headroom falls under this share of the cgroup limit (or of MemTotal for the node)."""
    headroom_bytes: int | None = None
    """An absolute headroom threshold in bytes; replaces ``headroom_fraction`` when set."""
    psi_some_avg10: float | None = 10.0
    """Fire when memory pressure ``some avg10`` (percent of wall time stalled) reaches this; None: off."""
    hysteresis_fraction: float = 0.02
    """Re-arm only after headroom is back above the threshold plus this share of the limit (and
    pressure under half its threshold): one event per episode, not one per poll."""

    def __post_init__(self) -> None:
        if not 0 < self.interval_s < math.inf:  # `not` also refuses NaN; inf would overflow the thread's wait
            raise RankmemError(f"NearOomConfig.interval_s must be a finite number of seconds > 0, "
                               f"got {self.interval_s}")
        if not 0 < self.headroom_fraction < 1:
            raise RankmemError(f"NearOomConfig.headroom_fraction must be in (0, 1), got {self.headroom_fraction}")
        if self.headroom_bytes is not None and not 0 < self.headroom_bytes < math.inf:
            raise RankmemError(f"NearOomConfig.headroom_bytes must be > 0 bytes, got {self.headroom_bytes}")
        if self.psi_some_avg10 is not None and not 0 < self.psi_some_avg10 <= 100:
            raise RankmemError(f"NearOomConfig.psi_some_avg10 must be in (0, 100] percent or None, "
                               f"got {self.psi_some_avg10}")
        if not 0 <= self.hysteresis_fraction < 1:
            raise RankmemError(f"NearOomConfig.hysteresis_fraction must be in [0, 1), got {self.hysteresis_fraction}")

    def threshold(self, capacity: int) -> int:
        return self.headroom_bytes if self.headroom_bytes is not None else int(capacity * self.headroom_fraction)


@dataclass(frozen=True, slots=True)
class _Reading:
    cgroup: _procfs.CgroupFiles | None
    """The cgroup with the least headroom of those limited on the path to the root."""
    cgroup_usage: int | None
    cgroup_limit: int | None
    cgroup_working_set: int | None
    node_total: int | None
    node_available: int | None
    pressure: _procfs.Pressure | None


class NearOomWatch:
    """Polls memory headroom and pressure on a daemon thread; calls ``on_near_oom(info)`` once per episode.

    ``info`` is the :class:`~rankmem.core.events.NearOomEvent` to write (this process's step and phase,
    ``reasons``, the figures and the per-node :func:`process_table`). The callback runs on the watch thread;
    an exception in it warns once. ``proc`` and ``cgroup_root`` point the watch at other files.
    """

    def __init__(
        self,
        on_near_oom: Callable[[NearOomEvent], None],
        config: NearOomConfig | None = None,
        *,
        rank: int | None = None,
        heartbeat_dir: str | None = None,
        proc: str = "/proc",
        cgroup_root: str = "/sys/fs/cgroup",
    ) -> None:
        self.config = config or NearOomConfig()
        self.on_near_oom = on_near_oom
        self.rank = rank
        self.heartbeat_dir = heartbeat_dir
        self.episodes = 0
        self.cpu_s = 0.0
        """CPU time the watch thread has used (``time.thread_time``), for the bench."""
        self._proc = proc
        self._armed = True
        guard = Guard()
        self._warn_once = guard.warn_once
        self._poll = guard.contain("nearoom", "the near-OOM watch failed")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._meminfo = _procfs.open_ro(f"{proc}/meminfo")
        cg = self.cgroup = _procfs.own_cgroup_files(proc, cgroup_root, tightest=False)
        # Every limited cgroup on the path to the root, watched at each poll: the one with the least room
        # binds first (a Slurm step limited while the task says max; a job whose siblings use its limit).
        self._cgroups = [_procfs.CgroupReader(c) for c in _procfs.limited_cgroups(cg, cgroup_root)] if cg else []
        # Pressure of the cgroup where v2 gives it, else of the node.
        cg_pressure = _procfs.open_ro(os.path.join(cg.dir, "memory.pressure")) if cg and cg.version == 2 else None
        self._pressure = cg_pressure if cg_pressure is not None else _procfs.open_ro(f"{proc}/pressure/memory")
        self.pressure_scope = "cgroup" if cg_pressure is not None else "node"

    # ---- thread ------------------------------------------------------------------------------------
    def start(self) -> NearOomWatch:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rankmem-nearoom", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread and close the descriptors."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return  # still inside a poll: closing now could hand its descriptor numbers to others
            self._thread = None
        for fd in (self._meminfo, self._pressure):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        for cgroup in self._cgroups:
            cgroup.close()
        self._cgroups = []
        self._meminfo = self._pressure = None

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            with self._poll:  # telemetry never kills training
                info = self.check()
                if info is not None:
                    self.on_near_oom(info)
            self.cpu_s = time.thread_time()

    # ---- one poll ----------------------------------------------------------------------------------
    def _read_figures(self) -> _Reading:
        # No limit anywhere: the own cgroup, its figures unknown (the event still says which cgroup).
        chosen: tuple[_procfs.CgroupFiles | None, int | None, int | None, int | None] = (self.cgroup, None, None, None)
        least = math.inf
        for cgroup in self._cgroups:
            usage, limit, working = cgroup.read()
            working = usage if working is None else working  # without memory.stat: an early warning beats none
            room = limit - working if limit is not None and working is not None else math.inf
            if limit is not None and (chosen[2] is None or room < least):
                chosen, least = (cgroup.files, usage, limit, working), room
        data = _procfs.pread(self._meminfo, _MEMINFO)
        total, available = (None, None) if data is None else _procfs.parse_meminfo(data)
        data = _procfs.pread(self._pressure, 256)
        pressure = None if data is None else _procfs.parse_pressure(data)
        return _Reading(*chosen, total, available, pressure)

    def check(self) -> NearOomEvent | None:
        """One poll: the ``info`` of a new episode, else None (also re-arms after recovery)."""
        reading = self._read_figures()
        reasons = self._reasons(reading, rearm=False)
        if reasons and self._armed:
            self._armed = False
            self.episodes += 1
            return self._info(reading, reasons)
        if not self._armed and not self._reasons(reading, rearm=True):
            self._armed = True
        return None

    def _reasons(self, r: _Reading, rearm: bool) -> list[str]:
        """Which thresholds ``r`` breaches; with ``rearm``, the stricter thresholds of recovery."""
        cfg = self.config
        margin = cfg.hysteresis_fraction if rearm else 0.0
        reasons = []
        if r.cgroup_limit is not None and r.cgroup_working_set is not None:
            if r.cgroup_limit - r.cgroup_working_set < cfg.threshold(r.cgroup_limit) + margin * r.cgroup_limit:
                reasons.append("cgroup_headroom")
        if r.node_total is not None and r.node_available is not None:
            if r.node_available < cfg.threshold(r.node_total) + margin * r.node_total:
                reasons.append("node_available")
        some = r.pressure.some if r.pressure is not None else None
        if cfg.psi_some_avg10 is not None and some is not None:
            # Re-arm under half the threshold: avg10 decays over ~10 s and hovers near it meanwhile.
            if some.avg10 >= (cfg.psi_some_avg10 / 2 if rearm else cfg.psi_some_avg10):
                reasons.append("pressure")
        return reasons

    def _info(self, r: _Reading, reasons: list[str]) -> NearOomEvent:
        beats = read_heartbeats(self.heartbeat_dir) if self.heartbeat_dir else {}
        table = process_table(beats, own_rank=self.rank, proc=self._proc)
        own = next((row for row in table if row["pid"] == os.getpid()), None)
        cfg = self.config
        cgroup = None
        if r.cgroup is not None:
            cgroup = {"version": r.cgroup.version, "dir": r.cgroup.dir, "usage_bytes": r.cgroup_usage,
                      "limit_bytes": r.cgroup_limit,
                      "working_set_bytes": r.cgroup_working_set,
                      "headroom_bytes": (r.cgroup_limit - r.cgroup_working_set
                                         if r.cgroup_limit is not None and r.cgroup_working_set is not None else None),
                      "threshold_bytes": cfg.threshold(r.cgroup_limit) if r.cgroup_limit is not None else None}
        some, full = (r.pressure.some, r.pressure.full) if r.pressure is not None else (None, None)
        return NearOomEvent(
            rank=self.rank, time=time.time(),
            step=own["step"] if own else None, phase=own["phase"] if own else None,
            reasons=tuple(reasons),
            cgroup=cgroup,
            node={"total_bytes": r.node_total, "available_bytes": r.node_available,
                  "threshold_bytes": cfg.threshold(r.node_total) if r.node_total is not None else None},
            pressure={"scope": self.pressure_scope,
                      "some_avg10": some.avg10 if some else None, "some_avg60": some.avg60 if some else None,
                      "full_avg10": full.avg10 if full else None},
            processes=table,
            largest=_largest(table),
        )


def _largest(table: list[dict[str, Any]]) -> dict[str, Any] | None:
    row = largest_private(table)
    return None if row is None else {k: row[k] for k in ("pid", "rank", "parent_pid", "name", "uss_bytes")}


def _boot_time(proc: str) -> float | None:
    data = _read(f"{proc}/stat", 1 << 16)
    if data is None:
        return None
    for line in data.splitlines():
        if line.startswith(b"btime "):
            return float(line.split()[1])
    return None


def _row(pid: int, rank: int | None, parent: int | None, proc: str, page: int) -> dict[str, Any] | None:
    # statm and comm are read from counters the kernel keeps: no lock on the process's memory map.
    statm = _read(f"{proc}/{pid}/statm", 256)
    if not statm:
        return None  # gone
    comm = _read(f"{proc}/{pid}/comm", 64)
    return {"pid": pid, "rank": rank, "parent_pid": parent,
            "name": comm.decode("utf-8", "replace").strip() if comm else None,
            "rss_bytes": _procfs.parse_statm_rss(statm, page),
            "uss_bytes": None,
            "step": None, "phase": None}


def _private_memory(rows: list[dict[str, Any]], proc: str) -> dict[str, Any] | None:
    """Read USS (``smaps_rollup``) only where it decides which process holds the most private memory;
    return that row. ``smaps_rollup`` walks the whole memory map under the process's mmap lock, which a
    rank's window edge (the clear_refs write) waits for. USS <= RSS, so in order of RSS, once the best USS
    found is at least the next RSS no later process can beat it: typically one or two reads."""
    best: dict[str, Any] | None = None
    for row in sorted(rows, key=lambda r: r["rss_bytes"] or 0, reverse=True):
        if best is not None and (row["rss_bytes"] or 0) <= best["uss_bytes"]:
            break
        smaps = _read(f"{proc}/{row['pid']}/smaps_rollup", 4096)
        row["uss_bytes"] = _procfs.parse_uss(smaps) if smaps else None
        if row["uss_bytes"] is not None and (best is None or row["uss_bytes"] > best["uss_bytes"]):
            best = row
    return best


def process_table(
    heartbeats: dict[int, HeartbeatRecord], own_rank: int | None = None, proc: str = "/proc"
) -> list[dict[str, Any]]:
    """Every live rank process on this node and its descendants: ``pid``, ``rank``, ``parent_pid`` (None
    for a rank process), ``name``, ``rss_bytes``, ``uss_bytes`` (read only where :func:`largest_private`
    needs it, else None), ``step`` and ``phase`` (ranks only, from the heartbeat). Ranks come from
    ``heartbeats``; one whose process exited cleanly, is gone, or whose pid was reused is skipped. This
    process is always listed. It runs when the watch fires, never per poll.
    """
    page = os.sysconf("SC_PAGE_SIZE")
    ticks = os.sysconf("SC_CLK_TCK")
    boot = _boot_time(proc)
    ranks: dict[int, HeartbeatRecord | None] = {}
    for _, record in sorted(heartbeats.items()):
        if record.clean:
            continue
        stat = _read(f"{proc}/{record.pid}/stat", 1024)
        start = None if stat is None else _procfs.parse_stat_starttime(stat)
        if start is None:
            continue
        if boot is not None and boot + start / ticks > record.time + 1.0:
            continue  # the pid now names a newer process
        ranks[record.pid] = record
    own = os.getpid()
    if own not in ranks:
        ranks[own] = None
    rows: list[dict[str, Any]] = []
    for pid, beat in ranks.items():
        rank = beat.rank if beat is not None else own_rank
        row = _row(pid, rank, None, proc, page)
        if row is None:
            continue
        if beat is not None:
            row["step"], row["phase"] = beat.step, beat.phase
        rows.append(row)
        for child in sorted(_procfs.descendants(pid, proc)):
            if child in ranks:
                continue
            child_row = _row(child, rank, pid, proc, page)
            if child_row is not None:
                rows.append(child_row)
    _private_memory(rows, proc)
    return rows  # ranks in rank order (this process last when it has no heartbeat), each followed by its descendants


def largest_private(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row of :func:`process_table` holding the most private memory (the one USS was read for that
    no other row's RSS could beat)."""
    known = [r for r in rows if r["uss_bytes"] is not None]
    return max(known, key=lambda r: r["uss_bytes"]) if known else None


def _counter(path: str, key: str) -> int | None:
    data = _read(path)
    return None if data is None else _procfs.parse_keyed(data).get(key)


def oom_kill_count(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """How many processes the OOM killer has killed in this process's memory cgroup itself; None when
    unreadable. v2 ``memory.events.local`` (``memory.events`` counts the descendants too: a cgroup made
    below, another job's, would be blamed), v1 ``memory.oom_control`` (``oom_kill`` since Linux 4.13,
    kills charged to this cgroup only)."""
    # Its own cgroup, not the tightest limit above it: the kernel counts a kill where the process was.
    cg = _procfs.own_cgroup_files(proc, cgroup_root, tightest=False)
    if cg is None:
        return None
    if cg.version == 2:
        return _counter(os.path.join(cg.dir, "memory.events.local"), "oom_kill")
    return _counter(os.path.join(cg.dir, "memory.oom_control"), "oom_kill")


def node_oom_kill_count(proc: str = "/proc") -> int | None:
    """OOM kills on the whole node, memory-cgroup kills included (``oom_kill`` of ``/proc/vmstat``,
    Linux >= 4.13); None when unreadable."""
    return _counter(f"{proc}/vmstat", "oom_kill")
