"""Host figures against ground truth we create: allocate and touch N MiB, expect the delta.

Tolerance: 16 MiB on a 256 MiB allocation (the interpreter, numpy and the allocator move a few MiB
on their own between two reads).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

import rankmem
from rankmem.core.units import GIB, MIB
from rankmem.probe.host import LinuxHostProbe, PsutilHostProbe, make_host_probe

TOL = 16 * MIB
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the /proc probe is Linux-only")


def touch(nbytes: int) -> np.ndarray:
    a = np.empty(nbytes, dtype=np.uint8)
    a.fill(1)  # write every page so it is resident
    return a


def test_rss_matches_psutil_within_tolerance() -> None:
    probe = make_host_probe(children=False)
    ours = probe.rss()
    theirs = psutil.Process().memory_info().rss
    assert ours is not None and abs(ours - theirs) < 2 * MIB
    probe.close()


@linux_only
def test_window_peak_catches_a_freed_spike_and_resets() -> None:
    monitor = rankmem.Monitor(sinks=(), device="cpu", children=False)
    base = psutil.Process().memory_info().rss  # ground truth from outside rankmem
    assert base is not None
    for n_mib in (256, 128):  # the second step proves the reset: its peak is the smaller spike
        with monitor.step(n_mib):
            with monitor.phase("rollout"):
                spike = touch(n_mib * MIB)
                del spike
        metrics = monitor.local_metrics()
        phase_peak = metrics["mem/phase/rollout/peak_rss_gib"] * GIB
        step_peak = metrics["mem/host/peak_rss_gib"] * GIB
        current = metrics["mem/host/rss_gib"] * GIB
        assert abs((phase_peak - base) - n_mib * MIB) < TOL, (n_mib, (phase_peak - base) / MIB)
        assert step_peak >= phase_peak  # the step's peak is the max over its phases and gaps
        assert abs(current - base) < TOL, (current - base) / MIB  # freed: no trace at step end
        assert abs(metrics["mem/phase/rollout/rss_delta_gib"] * GIB) < TOL
    monitor.close()


@linux_only
def test_phase_delta_shows_what_a_phase_leaves_behind() -> None:
    monitor = rankmem.Monitor(sinks=(), device="cpu", children=False)
    with monitor.step(0):
        with monitor.phase("update"):
            kept = touch(96 * MIB)
    metrics = monitor.local_metrics()
    assert abs(metrics["mem/phase/update/rss_delta_gib"] * GIB - 96 * MIB) < TOL
    assert kept.size == 96 * MIB
    monitor.close()


@linux_only
def test_peak_in_gap_between_phases_counts_for_the_step() -> None:
    monitor = rankmem.Monitor(sinks=(), device="cpu", children=False)
    base = psutil.Process().memory_info().rss  # ground truth from outside rankmem
    assert base is not None
    with monitor.step(0):
        with monitor.phase("a"):
            pass
        gap = touch(200 * MIB)
        del gap
        with monitor.phase("b"):
            pass
    metrics = monitor.local_metrics()
    assert abs(metrics["mem/host/peak_rss_gib"] * GIB - base - 200 * MIB) < TOL
    assert metrics["mem/phase/a/peak_rss_gib"] * GIB - base < TOL
    assert metrics["mem/phase/b/peak_rss_gib"] * GIB - base < TOL
    monitor.close()


def _child(n_mib: int, ready: mp.synchronize.Event, done: mp.synchronize.Event) -> None:
    held = touch(n_mib * MIB)
    ready.set()
    done.wait(60)
    del held


@linux_only
def test_children_rss_sees_a_dataloader_like_worker() -> None:
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    worker = ctx.Process(target=_child, args=(192, ready, done))
    worker.start()
    try:
        assert ready.wait(60)
        probe = LinuxHostProbe(children=True, children_refresh_s=0.001)
        time.sleep(0.01)
        children = probe.children_rss()
        # The outside tool: psutil's full /proc scan of our descendants (the spawn start method adds a
        # resource-tracker process beside the worker).
        expected = sum(p.memory_info().rss for p in psutil.Process().children(recursive=True))
        assert children is not None
        assert children >= 192 * MIB
        assert abs(children - expected) < 4 * MIB
        probe.close()
    finally:
        done.set()
        worker.join(30)


@linux_only
def test_node_and_cgroup_match_kernel_files() -> None:
    probe = LinuxHostProbe(children=False)
    total, available = probe.node()
    vm = psutil.virtual_memory()
    assert total == vm.total
    assert available is not None and abs(available - vm.available) < 64 * MIB
    used, limit, working = probe.cgroup()
    assert (used is None) == (limit is None)  # both absent when no limit applies
    assert working is None or (used is not None and working <= used)
    probe.close()


@linux_only
def test_a_collects_node_read_leaves_the_process_figures_to_the_edges() -> None:
    probe = LinuxHostProbe(children=True, children_refresh_s=60.0)
    full, node = probe.read(), probe.read(process=False)
    assert node.rss is None and node.peak_rss is None  # the closing edge reads them, not the collect
    assert full.rss is not None and full.peak_rss is not None
    assert node.node_total == full.node_total == psutil.virtual_memory().total
    assert node.node_available is not None and full.node_available is not None
    assert abs(node.node_available - full.node_available) < 64 * MIB
    assert (node.cgroup_limit, node.children_rss, node.peak_rss_is_lifetime) == (
        full.cgroup_limit, full.children_rss, full.peak_rss_is_lifetime)
    probe.close()


def test_psutil_fallback_flags_lifetime_peak() -> None:
    probe = PsutilHostProbe(children=False)
    reading = probe.read()
    assert reading.peak_rss_is_lifetime
    assert reading.rss is not None and reading.peak_rss is not None and reading.peak_rss >= reading.rss
    assert reading.node_total == psutil.virtual_memory().total
    assert reading.cgroup_used is None and reading.cgroup_limit is None and reading.cgroup_working_set is None
    assert reading.children_uss is None  # Linux-only: never a fake 0


def test_sample_is_lifetime_and_consistent() -> None:
    s = rankmem.sample(device="cpu")
    assert s.device is None and s.device_name == "none"
    assert s.host.peak_rss_is_lifetime
    assert s.host.rss is not None and s.host.peak_rss is not None and s.host.peak_rss >= s.host.rss
    metrics = s.to_metrics()
    assert abs(metrics["mem/host/rss_gib"] * GIB - psutil.Process().memory_info().rss) < 4 * MIB
    assert not any(k.startswith("mem/device/") for k in metrics)


@linux_only
def test_probe_reopens_after_fork() -> None:
    probe = LinuxHostProbe(children=False)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the probe must now read the child, not the parent it was opened in
        try:
            held = touch(64 * MIB)
            probe.edge()  # the window edge notices the fork itself (a fork counter, not getpid)
            status = os.pread(probe._status, 4096, 0) if probe._status is not None else b""
            read_pid = int(status.split(b"\nPid:")[1].split()[0])  # whose status the probe reads
            ours = probe.rss() or 0
            truth = psutil.Process().memory_info().rss  # an outside reading of the child itself
            os.write(w, f"{read_pid} {os.getpid()} {ours} {truth}".encode())
            del held
        finally:
            os._exit(0)
    os.close(w)
    read_pid, child_pid, ours, truth = (int(x) for x in os.read(r, 128).split())
    os.waitpid(pid, 0)
    assert read_pid == child_pid == pid  # the parent's descriptors would name the parent
    assert abs(ours - truth) < 2 * MIB
    probe.close()


# The child measured below: it holds anonymous memory and reads a file (page cache, charged to its
# cgroup), then reports the probe's cgroup figures next to the kernel's own files read just after.
CGROUP_CHILD = r"""
import json, os, sys, tempfile
import numpy as np
from rankmem.probe.host import LinuxHostProbe
held = np.ones(96 << 20, dtype=np.uint8)
with tempfile.NamedTemporaryFile(dir=sys.argv[1]) as f:
    f.write(b"x" * (64 << 20)); f.flush(); os.fsync(f.fileno())
    f.seek(0); f.read()
    probe = LinuxHostProbe(children=False)
    used, limit, working = probe.cgroup()
    cg = sys.argv[2]
    usage = int(open(f"{cg}/memory.usage_in_bytes").read())
    stat = dict(line.split() for line in open(f"{cg}/memory.stat"))
    print(json.dumps({"used": used, "limit": limit, "working": working, "usage": usage,
                      "inactive_file": int(stat["total_inactive_file"]), "cache": int(stat["total_cache"])}))
"""


@linux_only
def test_cgroup_working_set_is_read_from_the_kernel(tmp_path: Path) -> None:
    import json

    from tests.cgroup_helpers import run_in_cgroup, scratch_memory_cgroup
    from tests.conftest import REPO

    limit = 768 * MIB
    with scratch_memory_cgroup(limit) as cgroup:
        if not (cgroup / "memory.usage_in_bytes").exists():
            pytest.skip("the scratch cgroup is v2; this test reads the v1 files for its ground truth")
        # In before it allocates: the child waits until it has been moved into the cgroup.
        _, code, out, err = run_in_cgroup(cgroup, CGROUP_CHILD, [str(tmp_path), str(cgroup)],
                                          {**os.environ, "PYTHONPATH": str(REPO)})
    assert code == 0, err
    got = json.loads(out)
    assert got["limit"] == limit
    # The kernel's files, read a moment after the probe's: the same figures within a few MiB.
    assert abs(got["used"] - got["usage"]) < 8 * MIB
    assert abs(got["working"] - (got["usage"] - got["inactive_file"])) < 8 * MIB
    # The 64 MiB just read sits in the page cache: usage counts it, the working set leaves out what is inactive.
    assert got["cache"] >= 48 * MIB and got["working"] < got["used"]
    assert got["working"] >= 96 * MIB  # the anonymous memory the child holds is never reclaimable


def _forked_worker(m_mib: int, ready: int, release: int) -> None:
    """A dataloader worker: touches ``m_mib`` of its own, then waits. Nothing else, so that it copies as
    few of its parent's pages as it can (each Python object it touches is a copy-on-write fault)."""
    try:
        own = np.ones(m_mib * MIB, dtype=np.uint8)
        os.write(ready, b"x")
        os.read(release, 1)
        del own
    finally:
        os._exit(0)


@linux_only
def test_children_uss_counts_what_forked_workers_add_and_rss_overstates_it(only_new_children: list[int]) -> None:
    import gc

    n_mib, m_mib, workers = 256, 32, 4
    parent = np.ones(n_mib * MIB, dtype=np.uint8)  # the rank's own memory, mapped into every fork
    ready_r, ready_w = os.pipe()
    release_r, release_w = os.pipe()
    gc.freeze()  # a collection in a child would write every object's header: copies of the parent's heap
    pids = []
    try:
        for _ in range(workers):
            pid = os.fork()
            if pid == 0:
                _forked_worker(m_mib, ready_w, release_r)
            pids.append(pid)
        for _ in range(workers):
            assert os.read(ready_r, 1) == b"x"
        probe = LinuxHostProbe(children=True, children_refresh_s=60.0)
        reading = probe.read()  # the first USS pass runs on this thread; later ones on the probe's thread
        probe.close()
    finally:
        gc.unfreeze()
        os.write(release_w, b"x" * workers)
        for pid in pids:
            os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, release_r, release_w):
            os.close(fd)
    assert reading.children_uss is not None and reading.children_rss is not None
    added = workers * m_mib * MIB
    print(f"children_uss {reading.children_uss / MIB:.1f} MiB, children_rss {reading.children_rss / MIB:.1f} MiB, "
          f"workers added {added / MIB:.0f} MiB")
    assert abs(reading.children_uss - added) <= 0.15 * added + 8 * MIB
    # Each worker's RSS also counts the parent's pages it maps: at least the parent's array, once per worker.
    assert reading.children_rss > reading.children_uss + workers * n_mib * MIB * 0.9
    assert parent.size == n_mib * MIB
