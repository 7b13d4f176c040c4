"""The node, cgroup and children figures read off the training thread (rankmem.probe.nodewatch)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import warnings

import pytest

import rankmem
from rankmem.core.guard import Guard
from rankmem.core.records import HostReading
from rankmem.probe.nodewatch import NodeFigures


class _Reads:
    """A read function that numbers its readings (in ``node_available``) and notes which thread read."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.threads: list[str] = []
        self.fail_after = fail_after

    def __call__(self) -> HostReading:
        if self.fail_after is not None and len(self.threads) >= self.fail_after:
            raise OSError("/proc vanished")
        self.threads.append(threading.current_thread().name)
        return HostReading(rss=None, peak_rss=None, peak_rss_is_lifetime=False, children_rss=None, node_total=100,
                           node_available=len(self.threads), cgroup_used=None, cgroup_limit=None)


def _closed(node: NodeFigures) -> None:
    released: list[int] = []
    node.close(lambda: released.append(1))
    assert released == [1]  # the probe's descriptors closed, once
    assert node._thread is None or not node._thread.is_alive()


def test_after_the_first_read_the_caller_only_takes_the_threads_readings() -> None:
    reads = _Reads()
    node = NodeFigures(reads, 0.05, Guard())
    try:
        first, age = node.read()
        assert (first.node_available, age, reads.threads) == (1, 0.0, [threading.current_thread().name])
        time.sleep(0.5)
        taken = [node.read() for _ in range(20)]
        assert reads.threads[1:] and set(reads.threads[1:]) == {"rankmem-node"}  # none on the caller's thread
        reading, age = taken[-1]
        assert reading.node_available is not None and reading.node_available >= 3  # ~10 at 0.05 s apart
        assert 0.0 <= age < 0.05 + 0.5  # the refresh, plus a loaded machine's scheduling
    finally:
        _closed(node)


def test_the_age_is_the_time_since_the_read() -> None:
    reads = _Reads()
    node = NodeFigures(reads, 3600.0, Guard())  # the thread never reads again within the test
    try:
        node.read()
        time.sleep(0.3)
        reading, age = node.read()
        assert reading.node_available == 1 and 0.3 <= age < 0.3 + 0.5
    finally:
        _closed(node)


def test_none_reads_on_the_callers_thread_every_time() -> None:
    reads = _Reads()
    node = NodeFigures(reads, None, Guard())
    got = [node.read() for _ in range(3)]
    assert [(r.node_available, age) for r, age in got] == [(1, 0.0), (2, 0.0), (3, 0.0)]
    assert node._thread is None  # no thread was started
    _closed(node)


def test_a_failed_read_warns_once_and_hands_the_reads_back_to_the_caller() -> None:
    reads = _Reads(fail_after=3)  # the caller's first read, then two on the thread, then the error
    guard = Guard()
    node = NodeFigures(reads, 0.02, guard)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        node.read()
        deadline = time.monotonic() + 10
        while node._thread is not None and node._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
    assert not node._thread.is_alive()  # type: ignore[union-attr]
    assert [str(w.message) for w in caught if "node figures" in str(w.message)] == [
        "rankmem: the node figures' thread stopped; each collect reads them itself: OSError('/proc vanished')"]
    assert guard.failures == 1
    with pytest.raises(OSError, match="vanished"):  # the caller's read now, its own guard the judge
        node.read()
    reads.fail_after = None
    reading, age = node.read()
    assert age == 0.0 and reads.threads[-1] == threading.current_thread().name  # inline from now on
    _closed(node)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_reads_for_itself() -> None:
    reads = _Reads()
    node = NodeFigures(reads, 0.05, Guard())
    node.read()
    time.sleep(0.2)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread did not come with it, nor may its reading stand
        try:
            before = len(reads.threads)
            reading, age = node.read()
            ok = age == 0.0 and len(reads.threads) == before + 1 and reads.threads[-1] == "MainThread"
            os.write(write_end, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        assert os.read(read_end, 1) == b"1"
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
        _closed(node)


WORKER_48_MIB = ("import sys; b = bytearray(48 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
                 "print('ready', flush=True); sys.stdin.read()")


def test_a_monitor_sees_a_new_worker_within_the_refreshes_and_says_how_old_its_figures_are() -> None:
    """Ground truth: a child with 48 MiB touched appears in ``children_rss`` once the child list and the
    node thread have both refreshed, and ``mem/node/age_s`` stays within the node refresh."""
    monitor = rankmem.Monitor(sinks=(), device="cpu", near_oom_watch=False, children_refresh_s=0.05,
                              node_refresh_s=0.05, leak_check=False)
    worker = subprocess.Popen([sys.executable, "-c", WORKER_48_MIB], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        first = monitor.collect()
        assert first["mem/node/age_s/max"] == 0.0  # the first collect reads for itself
        assert worker.stdout is not None and worker.stdout.readline() == b"ready\n"
        time.sleep(0.5)
        got = monitor.collect()
        children = got["mem/host/children_rss_gib/max"]
        assert 48 / 1024 <= children <= (48 + 32) / 1024, children
        assert 0.0 < got["mem/node/age_s/max"] < 0.05 + 0.5
    finally:
        worker.kill()
        worker.wait(10)
        monitor.close()
    thread = monitor._windows.node._thread
    assert thread is not None and not thread.is_alive()  # close stopped it (other tests' monitors may hold theirs)


def test_figures_dropped_without_close_end_their_thread() -> None:
    import gc

    node = NodeFigures(_Reads(), 0.02, Guard())
    node.read()
    thread = node._thread
    assert thread is not None and thread.is_alive()
    del node
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


def test_a_close_that_outwaits_a_stuck_read_leaves_the_release_to_the_thread() -> None:
    """Closing descriptors under a read still running could hand their numbers to another file: the
    thread releases them when its read returns."""
    stuck = threading.Event()
    go_on = threading.Event()
    reads = _Reads()

    def read() -> HostReading:
        if len(reads.threads) >= 1 and threading.current_thread().name == "rankmem-node":
            stuck.set()
            go_on.wait(10)
        return reads()

    node = NodeFigures(read, 0.01, Guard())
    node.read()
    assert stuck.wait(10)
    released: list[str] = []
    node.close(lambda: released.append(threading.current_thread().name), timeout=0.1)
    assert released == []  # still inside the read
    go_on.set()
    node._thread.join(10)  # type: ignore[union-attr]
    assert released == ["rankmem-node"]

