"""The children's private memory: summed from fixed smaps_rollup text, refreshed on its own thread."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from rankmem.probe.children import ChildrenUss

KIB = 1024


def _rollup(path: Path, clean_kb: int, dirty_kb: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "smaps_rollup").write_text(
        "55d5c000-7ffd0000 ---p 00000000 00:00 0    [rollup]\nRss:  9000 kB\nPss:  3000 kB\n"
        f"Private_Clean:  {clean_kb} kB\nPrivate_Dirty:  {dirty_kb} kB\nSwap:  0 kB\n")


def test_sums_the_descendants_and_refreshes_off_the_callers_thread(tmp_path: Path) -> None:
    _rollup(tmp_path / "self", 1, 1)
    _rollup(tmp_path / "11", 100, 900)
    _rollup(tmp_path / "12", 0, 24)
    listed: list[str] = []
    kids = {11, 12, 13}  # 13 exited between the listing and the read: it adds nothing

    def descendants() -> set[int]:
        listed.append(threading.current_thread().name)
        return set(kids)

    uss = ChildrenUss(descendants, refresh_s=0.02, proc=str(tmp_path))
    assert uss.value() == (100 + 900 + 24) * KIB  # the first read, on the caller's thread
    assert listed == [threading.current_thread().name]
    _rollup(tmp_path / "12", 0, 2024)
    deadline = time.monotonic() + 5
    while uss.value() != (100 + 900 + 2024) * KIB and time.monotonic() < deadline:
        time.sleep(0.01)
    assert uss.value() == (100 + 900 + 2024) * KIB
    assert set(listed[1:]) == {"rankmem-children-uss"}  # every later pass ran on the refresh thread
    kids.clear()
    deadline = time.monotonic() + 5
    while uss.value() != 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert uss.value() == 0  # no children: 0, not unavailable
    uss.close()
    assert uss._thread is not None and not uss._thread.is_alive()


def test_a_kernel_without_smaps_rollup_gives_none(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    uss = ChildrenUss(lambda: {11}, refresh_s=60, proc=str(tmp_path))
    with pytest.warns(RuntimeWarning, match=r"no /proc/PID/smaps_rollup \(Linux < 4.14\)"):
        assert not uss.supported and uss.value() is None
    uss.close()


WORKER_64_MIB = ("import sys, time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); "
                 "print('ready', flush=True); time.sleep(60)")


def test_the_logging_rank_starts_no_process_and_counts_a_workers_memory(tmp_path: Path,
                                                                         only_new_children: list[int]) -> None:
    """The run log is written by the logging rank's own thread: no process besides the rank exists
    during a run, while a worker the test starts with 64 MiB touched is counted."""
    import subprocess
    import sys

    import psutil

    import rankmem
    from rankmem.core.catalogue import key_of

    monitor = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", near_oom_watch=False, children_refresh_s=0.05,
                              node_refresh_s=0.05)
    try:
        monitor.collect({"loss": 1.0})
        assert monitor.flush(30)
        assert psutil.Process().children(recursive=True) == []
        time.sleep(0.1)
        got = monitor.collect({"loss": 1.0})
        assert got[key_of("children_rss") + "/max"] == 0.0
        worker = subprocess.Popen([sys.executable, "-c", WORKER_64_MIB], stdout=subprocess.PIPE)  # a plain worker
        try:
            assert worker.stdout is not None and worker.stdout.readline() == b"ready\n"
            time.sleep(0.2)
            got = monitor.collect({"loss": 1.0})
            # its 64 MiB plus a bare interpreter (~10 MiB)
            assert 64 / 1024 <= got[key_of("children_rss") + "/max"] <= 96 / 1024, got[key_of("children_rss") + "/max"]
        finally:
            worker.kill()
            worker.wait(10)
    finally:
        monitor.close()
