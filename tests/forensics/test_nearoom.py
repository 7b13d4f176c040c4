"""The near-OOM watch: firing once per episode on a fake /proc and cgroup tree, its per-node process
table, the OOM-kill counters, and (where this machine lets a test make a memory cgroup) firing on a
real cgroup as a process allocates toward its limit."""

from __future__ import annotations

import json
import math
import os
import struct
import threading
import time
from pathlib import Path

import pytest

from rankmem.errors import RankmemError
from rankmem.forensics.heartbeat import Heartbeat, read_heartbeats
from rankmem.forensics.nearoom import (
    NearOomConfig,
    NearOomWatch,
    largest_private,
    node_oom_kill_count,
    oom_kill_count,
    process_table,
)
from tests.cgroup_helpers import run_in_cgroup, scratch_memory_cgroup
from tests.conftest import REPO

MIB, GIB = 1 << 20, 1 << 30
PAGE = os.sysconf("SC_PAGE_SIZE")
TICKS = os.sysconf("SC_CLK_TCK")
PSI_CALM = "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"


class FakeRoot:
    """A /proc and a cgroup v2 tree in tmp_path: the cgroup ``/job`` with a 1 GiB limit on a 16 GiB node."""

    def __init__(self, tmp: Path) -> None:
        self.proc, self.cg = tmp / "proc", tmp / "cg"
        self.job = self.cg / "job"
        self.put(self.proc / "self" / "cgroup", "0::/job\n")
        self.put(self.proc / "stat", "cpu  1 2 3\nbtime 1000\n")
        self.put(self.proc / "vmstat", "nr_free_pages 1\noom_kill 4\n")
        self.meminfo(available=12 * GIB)
        self.put(self.proc / "pressure" / "memory", PSI_CALM)
        self.put(self.job / "memory.max", f"{GIB}\n")
        self.put(self.job / "memory.events", "low 0\nhigh 0\nmax 0\noom 0\noom_kill 5\n")  # a child's 3 too
        self.put(self.job / "memory.events.local", "low 0\nhigh 0\nmax 0\noom 0\noom_kill 2\n")
        self.put(self.job / "memory.pressure", PSI_CALM)
        self.usage(500 * MIB, inactive_file=100 * MIB)

    @staticmethod
    def put(path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)  # truncates in place: the watch's open descriptors see the new text

    def meminfo(self, available: int) -> None:
        self.put(self.proc / "meminfo", f"MemTotal: {16 * GIB // 1024} kB\nMemFree: 1 kB\n"
                                        f"MemAvailable: {available // 1024} kB\n")

    def usage(self, current: int, inactive_file: int = 0) -> None:
        self.put(self.job / "memory.current", f"{current}\n")
        self.put(self.job / "memory.stat", f"anon {current}\ninactive_file {inactive_file}\n")

    def process(self, pid: int, rss: int, uss_kb: tuple[int, int], start_s: float, children: str = "",
                name: str = "python") -> None:
        base = self.proc / str(pid)
        self.put(base / "statm", f"9999 {rss // PAGE} 1 1 0 1 0\n")
        self.put(base / "smaps_rollup", f"Rss: 1 kB\nPrivate_Clean: {uss_kb[0]} kB\nPrivate_Dirty: {uss_kb[1]} kB\n")
        self.put(base / "comm", name + "\n")
        starttime = int((start_s - 1000) * TICKS)  # ticks after btime 1000
        self.put(base / "stat", f"{pid} ({name}) S " + " ".join(["0"] * 18) + f" {starttime} 0 0\n")
        self.put(base / "task" / str(pid) / "children", children)


@pytest.fixture
def root(tmp_path: Path) -> FakeRoot:
    return FakeRoot(tmp_path)


def watch(root: FakeRoot, config: NearOomConfig | None = None, rank: int | None = None,
          heartbeat_dir: Path | None = None) -> NearOomWatch:
    return NearOomWatch(lambda info: None, config or NearOomConfig(psi_some_avg10=None), rank=rank,
                        heartbeat_dir=str(heartbeat_dir) if heartbeat_dir else None, proc=str(root.proc),
                        cgroup_root=str(root.cg))


def test_fires_once_per_episode_and_rearms_after_recovery(root: FakeRoot) -> None:
    w = watch(root)  # thresholds: 5% of the 1 GiB limit (51.2 MiB), re-arm above 5% + 2%
    assert w.cgroup is not None and w.cgroup.version == 2 and w.pressure_scope == "cgroup"
    assert w.check() is None
    # Usage 1000 MiB but 30 MiB of it inactive file cache: the working set is 970 MiB, headroom 54 MiB.
    root.usage(1000 * MIB, inactive_file=30 * MIB)
    assert w.check() is None
    root.usage(1000 * MIB, inactive_file=0)  # headroom 24 MiB < 51.2 MiB
    info = w.check()
    assert info is not None and info.reasons == ("cgroup_headroom",) and w.episodes == 1
    assert info.kind == "near_oom"
    assert info.cgroup == {"version": 2, "dir": str(root.job), "usage_bytes": 1000 * MIB, "limit_bytes": GIB,
                              "working_set_bytes": 1000 * MIB, "headroom_bytes": 24 * MIB,
                              "threshold_bytes": int(GIB * 0.05)}
    assert info.node == {"total_bytes": 16 * GIB, "available_bytes": 12 * GIB, "threshold_bytes": int(16 * GIB * 0.05)}
    assert w.check() is None  # same episode
    root.usage(960 * MIB)  # headroom 64 MiB: above the threshold, under threshold + hysteresis (71.7 MiB)
    assert w.check() is None
    root.usage(1000 * MIB)
    assert w.check() is None and w.episodes == 1  # never re-armed: still the first episode
    root.usage(900 * MIB)  # recovered: re-armed
    assert w.check() is None
    root.usage(1010 * MIB)
    info = w.check()
    assert info is not None and w.episodes == 2
    w.stop()


def test_node_available_and_pressure_fire(root: FakeRoot) -> None:
    w = watch(root, NearOomConfig(psi_some_avg10=10.0))
    root.meminfo(available=512 * MIB)  # under 5% of 16 GiB
    info = w.check()
    assert info is not None and info.reasons == ("node_available",)
    root.meminfo(available=12 * GIB)
    root.put(root.job / "memory.pressure",
             "some avg10=6.00 avg60=1.0 avg300=0.5 total=9\nfull avg10=1.0 avg60=0 avg300=0 total=1\n")
    assert w.check() is None  # 6% stalled: still above half the threshold (5%), so not re-armed yet
    root.put(root.job / "memory.pressure", PSI_CALM)
    assert w.check() is None  # re-armed
    root.put(root.job / "memory.pressure",
             "some avg10=25.00 avg60=5.0 avg300=1.0 total=99\nfull avg10=7.5 avg60=0 avg300=0 total=1\n")
    info = w.check()
    assert info is not None and info.reasons == ("pressure",)
    assert info.pressure == {"scope": "cgroup", "some_avg10": 25.0, "some_avg60": 5.0, "full_avg10": 7.5}
    w.stop()


def test_absolute_threshold_and_no_limit(root: FakeRoot) -> None:
    root.put(root.job / "memory.max", "max\n")  # no cgroup limit: only the node counts
    w = watch(root, NearOomConfig(headroom_bytes=13 * GIB, psi_some_avg10=None))
    info = w.check()
    assert info is not None and info.reasons == ("node_available",)
    assert info.cgroup["limit_bytes"] is None and info.node["threshold_bytes"] == 13 * GIB
    w.stop()


def test_unreadable_sources_never_fire(tmp_path: Path) -> None:
    w = NearOomWatch(lambda info: None, proc=str(tmp_path / "none"), cgroup_root=str(tmp_path / "none"))
    assert w.cgroup is None and w.check() is None
    w.stop()


def test_process_table_from_heartbeats(root: FakeRoot, tmp_path: Path) -> None:
    hb_dir = tmp_path / "hb"
    now = time.time()
    # Rank 1 (pid 4242) with a dataloader worker 4343 that forked its own child 4444.
    root.process(4242, rss=900 * MIB, uss_kb=(1024, 700 * 1024), start_s=now - 60, children="4343")
    root.process(4343, rss=300 * MIB, uss_kb=(0, 50 * 1024), start_s=now - 50, children="4444", name="pt_worker")
    root.process(4444, rss=10 * MIB, uss_kb=(0, 1024), start_s=now - 40)
    # Rank 2's pid 5252 now names a process that started after rank 2's last beat: a reused pid.
    root.process(5252, rss=MIB, uss_kb=(0, 0), start_s=now + 30)
    root.process(os.getpid(), rss=200 * MIB, uss_kb=(0, 150 * 1024), start_s=now - 70)
    _fake_heartbeat(hb_dir, rank=1, pid=4242, step=57, phase="update", t=now)
    _fake_heartbeat(hb_dir, rank=2, pid=5252, step=57, phase="update", t=now)
    _fake_heartbeat(hb_dir, rank=3, pid=6262, step=57, phase="update", t=now)  # gone
    table = process_table(read_heartbeats(str(hb_dir)), own_rank=0, proc=str(root.proc))
    rows = [(r["pid"], r["rank"], r["parent_pid"], r["rss_bytes"], r["uss_bytes"], r["step"], r["phase"])
            for r in table]
    # Private memory only where it decides the largest: rank 1's 701 MiB beats every other RSS.
    assert rows == [
        (4242, 1, None, 900 * MIB, 701 * MIB, 57, "update"),
        (4343, 1, 4242, 300 * MIB, None, None, None),
        (4444, 1, 4242, 10 * MIB, None, None, None),
        (os.getpid(), 0, None, 200 * MIB, None, None, None),
    ]
    assert table[1]["name"] == "pt_worker"
    # The watch's event carries the table.
    root.usage(1010 * MIB)
    w = watch(root, rank=0, heartbeat_dir=hb_dir)
    info = w.check()
    assert info is not None and [r["pid"] for r in info.processes] == [4242, 4343, 4444, os.getpid()]
    assert info.largest == {"pid": 4242, "rank": 1, "parent_pid": None, "name": info.processes[0]["name"],
                               "uss_bytes": 701 * MIB}
    assert info.rank == 0 and info.step is None  # this process has no heartbeat of its own
    w.stop()


def test_private_memory_is_read_only_where_it_decides_the_largest(root: FakeRoot, tmp_path: Path) -> None:
    """A forked worker shares most of its rank's RSS: the rank's USS is small, so the worker's (RSS above
    it) must be read, and it holds the most; the rest (RSS under 600 MiB) cannot beat it and are not read."""
    hb_dir = tmp_path / "hb"
    now = time.time()
    root.process(4242, rss=900 * MIB, uss_kb=(0, 100 * 1024), start_s=now - 60, children="4343")
    root.process(4343, rss=800 * MIB, uss_kb=(0, 600 * 1024), start_s=now - 50, name="pt_worker")
    root.process(5252, rss=500 * MIB, uss_kb=(0, 450 * 1024), start_s=now - 60)
    root.process(os.getpid(), rss=200 * MIB, uss_kb=(0, 150 * 1024), start_s=now - 70)
    _fake_heartbeat(hb_dir, rank=1, pid=4242, step=3, phase="rollout", t=now)
    _fake_heartbeat(hb_dir, rank=2, pid=5252, step=3, phase="rollout", t=now)
    table = process_table(read_heartbeats(str(hb_dir)), own_rank=0, proc=str(root.proc))
    assert [(r["pid"], r["uss_bytes"]) for r in table] == [
        (4242, 100 * MIB), (4343, 600 * MIB), (5252, None), (os.getpid(), None)]
    assert largest_private(table) is table[1]


def _fake_heartbeat(directory: Path, rank: int, pid: int, step: int, phase: str, t: float) -> None:
    """A heartbeat as the rank ``pid`` would have written it."""
    hb = Heartbeat(str(directory), rank)
    hb.beat(step, phase, GIB)
    hb.close(clean=False)
    data = bytearray((directory / f"rank{rank}.hb").read_bytes())
    # pid sits after magic (4), version (2), flags (2); the time after seq, step and rss.
    data[8:12] = pid.to_bytes(4, "little")
    struct.pack_into("<d", data, 4 + 2 + 2 + 4 + 4 + 8 + 8 + 8, t)
    (directory / f"rank{rank}.hb").write_bytes(bytes(data))
    assert read_heartbeats(str(directory))[rank].pid == pid


def test_thread_calls_back_and_survives_a_failing_callback(root: FakeRoot) -> None:
    fired = threading.Event()
    calls: list[dict[str, object]] = []

    def on_near_oom(info: dict[str, object]) -> None:
        calls.append(info)
        fired.set()
        raise RuntimeError("sink down")

    w = NearOomWatch(on_near_oom, NearOomConfig(interval_s=0.01, psi_some_avg10=None), proc=str(root.proc),
                     cgroup_root=str(root.cg))
    with pytest.warns(RuntimeWarning, match="near-OOM watch failed: RuntimeError"):
        w.start()
        root.usage(1020 * MIB)
        assert fired.wait(5)
        root.usage(100 * MIB)
        deadline = time.monotonic() + 5  # the thread sees the recovery and re-arms
        while not w._armed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w._armed
        fired.clear()
        root.usage(1020 * MIB)
        assert fired.wait(5)  # the thread lived on and a second episode fired
        w.stop()
    assert len(calls) == 2 and w.cpu_s > 0


def test_config_is_checked() -> None:
    with pytest.raises(RankmemError, match=r"headroom_fraction must be in \(0, 1\), got 5"):
        NearOomConfig(headroom_fraction=5)
    with pytest.raises(RankmemError, match="interval_s must be a finite number of seconds > 0, got 0"):
        NearOomConfig(interval_s=0)
    with pytest.raises(RankmemError, match="interval_s must be a finite number of seconds > 0, got inf"):
        NearOomConfig(interval_s=math.inf)  # the watch thread's wait would overflow
    with pytest.raises(RankmemError, match="headroom_bytes must be > 0 bytes, got nan"):
        NearOomConfig(headroom_bytes=math.nan)  # would never fire
    with pytest.raises(RankmemError, match="psi_some_avg10 must be in"):
        NearOomConfig(psi_some_avg10=150)
    with pytest.raises(RankmemError, match="headroom_bytes must be > 0 bytes"):
        NearOomConfig(headroom_bytes=-1)


def test_oom_kill_counters(root: FakeRoot, tmp_path: Path) -> None:
    assert oom_kill_count(str(root.proc), str(root.cg)) == 2
    assert node_oom_kill_count(str(root.proc)) == 4
    v1 = tmp_path / "v1"
    FakeRoot.put(v1 / "proc" / "self" / "cgroup", "4:memory:/jobs/a\n0::/\n")
    base = v1 / "cg" / "memory" / "jobs" / "a"
    FakeRoot.put(base / "memory.usage_in_bytes", "1\n")
    FakeRoot.put(base / "memory.limit_in_bytes", "9223372036854771712\n")
    FakeRoot.put(base / "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 9\n")
    assert oom_kill_count(str(v1 / "proc"), str(v1 / "cg")) == 9
    (base / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\n")  # Linux < 4.13
    assert oom_kill_count(str(v1 / "proc"), str(v1 / "cg")) is None
    assert oom_kill_count(str(tmp_path / "none"), str(tmp_path / "none")) is None
    assert node_oom_kill_count(str(tmp_path / "none")) is None


# ---- the real kernel ---------------------------------------------------------------------------------
ALLOCATOR = """
import json, os, sys, threading
from rankmem.forensics.nearoom import NearOomConfig, NearOomWatch
fired, infos = threading.Event(), []
def on_near_oom(info):
    infos.append(info)
    fired.set()
watch = NearOomWatch(on_near_oom, NearOomConfig(interval_s=0.02, headroom_bytes=int(sys.argv[1]), psi_some_avg10=None),
rank=0)
watch.start()
chunks, chunk = [], 4 << 20
while not fired.wait(0.02) and len(chunks) < int(sys.argv[2]):
    chunks.append(bytearray(b"\\1") * chunk)  # written, so resident and charged to the cgroup
watch.stop()
print(json.dumps({"allocated": len(chunks) * chunk, "info": infos[0].to_json() if infos else None}))
"""


def test_fires_on_a_real_memory_cgroup() -> None:
    limit, threshold = 256 * MIB, 48 * MIB
    with scratch_memory_cgroup(limit) as cgroup:
        # The child joins the cgroup before it starts: a blocking pipe read holds it until moved.
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        pid, code, out, err = run_in_cgroup(cgroup, ALLOCATOR, [str(threshold), str(limit // (4 * MIB))], env)
    assert code == 0, f"exit {code} (-9: the limit was reached before the watch fired)\n{err}"
    result = json.loads(out)
    info = result["info"]
    assert info is not None, (f"no event after allocating {result['allocated'] >> 20} MiB under a "
                              f"{limit >> 20} MiB limit")
    assert info["reasons"] == ["cgroup_headroom"]
    cg = info["cgroup"]
    assert cg["limit_bytes"] == limit and cg["headroom_bytes"] < threshold
    assert cg["working_set_bytes"] > limit - threshold
    me = info["processes"][0]
    assert me["pid"] == pid and me["rank"] == 0
    # The child's own RSS and private memory hold what it allocated (within its interpreter's ~30 MiB).
    assert me["rss_bytes"] >= result["allocated"] and me["uss_bytes"] >= result["allocated"]



def _fake_nested_cgroup(tmp_path, own_max: bytes = b"max\n"):
    """cgroup v2, as Slurm (job/step limited, task not) or a systemd slice with MemoryMax lays it out:
    the process sits in job/step/task, whose memory.max is 'max'; its parent step has a 1 GiB limit."""
    proc, root = tmp_path / "proc", tmp_path / "cg"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/job/step/task\n")
    (proc / "meminfo").write_text("MemTotal:       263000000 kB\nMemAvailable:   250000000 kB\n")
    step, task = root / "job" / "step", root / "job" / "step" / "task"
    task.mkdir(parents=True)
    (step / "memory.max").write_bytes(b"%d\n" % GIB)
    (step / "memory.current").write_bytes(b"%d\n" % (GIB - 10 * MIB))
    (step / "memory.stat").write_bytes(b"anon 1000000000\ninactive_file 0\n")
    (task / "memory.max").write_bytes(own_max)
    (task / "memory.current").write_bytes(b"%d\n" % (GIB - 10 * MIB))
    (task / "memory.stat").write_bytes(b"anon 1000000000\ninactive_file 0\n")
    return str(proc), str(root)



def test_near_oom_watch_sees_an_ancestor_cgroups_limit(tmp_path):
    """The OOM killer acts at the tightest limit on the path to the root, not only the process's own
    memory.max. With the process's own cgroup unlimited ('max') and its parent limited to 1 GiB with
    10 MiB left, the watch reads 'no limit' (_procfs.parse_cgroup_limit -> None, _nearoom.py
    _read_figures) and never fires: the node has 250 GB available, so no other reason fires either."""
    from rankmem.forensics.nearoom import NearOomWatch

    proc, root = _fake_nested_cgroup(tmp_path)
    watch = NearOomWatch(lambda info: None, proc=proc, cgroup_root=root)
    try:
        info = watch.check()
    finally:
        watch.stop()
    assert info is not None and "cgroup_headroom" in info.reasons  # fails: info is None


def test_the_limit_with_the_least_room_binds_not_the_smallest(tmp_path: Path) -> None:
    """Slurm: the job's 4 GiB limit is nearly used up by sibling steps while this step (1 GiB limit)
    uses 100 MiB: the job's limit is the one the OOM killer will enforce, so the watch fires on it."""
    proc, root = tmp_path / "proc", tmp_path / "cg"
    FakeRoot.put(proc / "self" / "cgroup", "0::/job/step/task\n")
    FakeRoot.put(proc / "meminfo", "MemTotal:       263000000 kB\nMemAvailable:   250000000 kB\n")
    for path, limit, usage in (("job", 4 * GIB, 4 * GIB - 50 * MIB), ("job/step", GIB, 100 * MIB),
                               ("job/step/task", None, 100 * MIB)):
        FakeRoot.put(root / path / "memory.max", "max\n" if limit is None else f"{limit}\n")
        FakeRoot.put(root / path / "memory.current", f"{usage}\n")
        FakeRoot.put(root / path / "memory.stat", "anon 1\ninactive_file 0\n")
    w = NearOomWatch(lambda info: None, proc=str(proc), cgroup_root=str(root),
                     config=NearOomConfig(psi_some_avg10=None))
    try:
        info = w.check()
    finally:
        w.stop()
    assert info is not None and info.reasons == ("cgroup_headroom",)
    assert info.cgroup["dir"] == str(root / "job") and info.cgroup["headroom_bytes"] == 50 * MIB
