"""Forensics through the Monitor: OOM events from windows, the allocator's observer and history, heartbeats."""

from __future__ import annotations

import contextlib
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

import rankmem
from rankmem.core.units import GIB, MIB
from rankmem.forensics.heartbeat import read_heartbeats
from rankmem.offline.events import read_events
from rankmem.testing import FakeCuda, FakeOutOfMemoryError


def test_device_oom_in_a_phase_is_an_event_with_the_allocator_figures(tmp_path: Path) -> None:
    cuda = FakeCuda(total=8 * GIB, context=300 * MIB)
    monitor = rankmem.Monitor(out_dir=str(tmp_path), device_module=cuda, children=False, oom_history=64,
                              near_oom_watch=False)
    held = [cuda.malloc(1 * GIB), cuda.malloc(3 * GIB)]
    raised: BaseException | None = None
    for step in range(4):
        with pytest.raises(FakeOutOfMemoryError) if step == 3 else contextlib.nullcontext():
            with monitor.step(step):
                with monitor.phase("rollout"):
                    pass
                with monitor.phase("update"):
                    if step == 3:
                        try:
                            cuda.malloc(6 * GIB)  # more than the device has left
                        except FakeOutOfMemoryError as exc:
                            raised = exc
                            raise
        monitor.collect()
    monitor.close()
    event, anatomy = read_events(str(tmp_path)).events
    assert (event.kind, event.rank, event.step, event.phase, event.where) == ("oom", 0, 3, "update", "device")
    # The snapshot replayed off the training thread: the blocks live as the allocation failed, largest first.
    assert (anatomy.kind, anatomy.step, anatomy.phase) == ("anatomy", 3, "update")
    assert anatomy.extra["source"] == "oom" and anatomy.extra["instant"] == "oom"
    assert anatomy.extra["requested_bytes"] == 6 * GIB and anatomy.extra["peak_bytes"] == 4 * GIB
    # Both held from before the history began, where no stack was kept: one holder of two blocks.
    assert anatomy.extra["top"] == [["pre_window", "(no Python frame)", 4 * GIB, 2]]
    assert anatomy.extra["categories"]["pre_window"] == 4 * GIB
    assert raised is not None and event.error.startswith("FakeOutOfMemoryError: CUDA out of memory. Tried to allocate")
    assert abs(event.requested_bytes - 6 * GIB) <= 0.01 * 6 * GIB  # parsed from the error text
    assert event.observer["alloc_bytes"] == 6 * GIB  # what the allocator's observer was told
    device = event.device
    assert device["total_bytes"] == 8 * GIB
    assert device["allocated_bytes"] == 4 * GIB and device["reserved_bytes"] == 4 * GIB
    assert device["free_bytes"] == 8 * GIB - 300 * MIB - 4 * GIB
    sizes = [s["allocated_size"] for s in device["top_segments"]]
    assert sizes == [3 * GIB, 1 * GIB]  # the largest live segments, largest first
    assert event.host["rss_bytes"] > 0
    with open(event.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    traces = [e for e in snapshot["device_traces"][0] if e["action"] != "snapshot"]  # each snapshot's mark
    assert traces[-1]["action"] == "oom" and traces[-1]["user_metadata"] == "step 3 / update"
    assert len(held) == 2


def test_a_real_memory_error_in_a_phase_is_a_host_event_and_goes_on_unchanged(tmp_path: Path) -> None:
    monitor = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", children=False, near_oom_watch=False)
    with pytest.raises(MemoryError) as info:
        with monitor.step(7):
            with monitor.phase("log_prob"):
                np.ones(1 << 62, dtype=np.uint8)  # 4 EiB: numpy raises MemoryError (a real one)
    monitor.close()
    (event,) = read_events(str(tmp_path)).events
    assert (event.kind, event.step, event.phase, event.where) == ("oom", 7, "log_prob", "host")
    assert event.error.startswith("MemoryError: ") and str(info.value) in event.error
    assert event.device is None
    assert event.host["node_available_bytes"] > 0


def test_torchs_cpu_allocator_failing_in_a_phase_is_a_host_event(tmp_path: Path) -> None:
    import torch

    monitor = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", children=False, near_oom_watch=False)
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator") as info:
        with monitor.step(4):
            with monitor.phase("update"):
                torch.empty(1 << 60, dtype=torch.uint8)  # 1 EiB: a plain RuntimeError from torch, not MemoryError
    monitor.close()
    (event,) = read_events(str(tmp_path)).events
    assert (event.kind, event.step, event.phase, event.where) == ("oom", 4, "update", "host")
    assert event.requested_bytes == 1 << 60 and event.error.startswith("RuntimeError: ")
    assert str(info.value).splitlines()[0] in event.error


def test_an_oom_caught_inside_the_window_is_still_recorded(tmp_path: Path) -> None:
    cuda = FakeCuda(total=4 * GIB)
    monitor = rankmem.Monitor(out_dir=str(tmp_path), device_module=cuda, children=False, near_oom_watch=False)
    cuda.malloc(MIB)  # CUDA initialised: the observer is attached at the next edge
    with monitor.step(0):
        with monitor.phase("rollout"):
            try:
                cuda.malloc(8 * GIB)
            except FakeOutOfMemoryError:
                pass  # the caller retries with a smaller batch
    monitor.close()
    (event,) = read_events(str(tmp_path)).events
    assert (event.kind, event.step, event.phase) == ("oom", 0, "rollout")
    assert event.observer["alloc_bytes"] == 8 * GIB


def test_other_errors_leave_no_event_and_events_need_a_directory(tmp_path: Path) -> None:
    monitor = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", children=False, near_oom_watch=False)
    with pytest.raises(KeyError):
        with monitor.step(0):
            raise KeyError("not memory")
    monitor.close()
    assert read_events(str(tmp_path)).events == []
    assert not (tmp_path / "events").exists()


def test_a_file_where_the_events_directory_belongs_is_moved_aside_and_nothing_is_lost(tmp_path: Path) -> None:
    (tmp_path / "events").write_text("a file where the directory should be")
    monitor = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", children=False, near_oom_watch=False)
    for step in range(2):
        with pytest.raises(MemoryError):
            with monitor.step(step):
                raise MemoryError("simulated")
    out = monitor.collect({"loss": 1.0})
    monitor.close()
    assert out["loss/max"] == 1.0
    assert [(e.kind, e.step) for e in read_events(str(tmp_path)).events] == [("oom", 0), ("oom", 1)]
    assert (tmp_path / "events.1").read_text() == "a file where the directory should be"  # kept, as an earlier run's


def test_heartbeats_follow_window_edges_and_close_cleanly(tmp_path: Path) -> None:
    monitor = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", children=False, near_oom_watch=False)
    with monitor.step(5):
        with monitor.phase("update"):
            beat = read_heartbeats(str(tmp_path / "heartbeat"))[0]
            assert (beat.step, beat.phase, beat.clean) == (5, "update", False)
            assert abs(beat.rss_bytes - _statm_rss()) < 16 * MIB
    monitor.close()
    beat = read_heartbeats(str(tmp_path / "heartbeat"))[0]
    assert beat.clean


def test_report_json_lists_events_first_in_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rankmem.cli import main

    monitor = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", children=False, near_oom_watch=False)
    for step in range(3):
        with monitor.step(step):
            pass
        monitor.collect()
    with pytest.raises(MemoryError):
        with monitor.step(3), monitor.phase("update"):
            raise MemoryError("simulated")
    monitor.close()
    assert main(["report", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (event,) = report["events"]
    assert (event["kind"], event["rank"], event["step"], event["phase"]) == ("oom", 0, 3, "update")
    assert main(["report", str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("EVENT oom rank 0 step 3 phase update: host MemoryError: simulated; RSS ")


def _statm_rss() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_rank_that_runs_out_of_address_space_leaves_an_oom_event(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.conftest import REPO, torchrun

    proc = torchrun(REPO / "tests/dist_scripts/host_oom_worker.py", 2, [str(tmp_path)], timeout=120)
    assert proc.returncode != 0
    assert "MemoryError" in proc.stderr  # the user's exception, unchanged, is what failed the job
    report = subprocess.run([sys.executable, "-m", "rankmem", "report", str(tmp_path), "--json"],
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    events = [e for e in json.loads(report.stdout)["events"] if e["kind"] == "oom"]
    assert [(e["rank"], e["step"], e["phase"], e["where"]) for e in events] == [(1, 3, "update", "host")]



def test_oom_event_in_an_unnumbered_step_names_the_step_the_run_log_uses(tmp_path: Path) -> None:
    """``with monitor.step():`` (no number) logs collects as steps 0, 1, 2, ...: the OOM event of the
    third step says 2. Where the collects are numbered (``collect(step=it)`` every 10 iterations) the
    collect count is no step number: the event says None (unknown), never a wrong number."""
    m = rankmem.Monitor(out_dir=str(tmp_path / "plain"), device="cpu", children=False, near_oom_watch=False)
    for i in range(3):
        try:
            with m.step():
                if i == 2:
                    raise MemoryError("boom")
        except MemoryError:
            pass
        m.collect()
    m.close()
    logged = rankmem.offline.read_run(str(tmp_path / "plain")).steps.tolist()
    assert logged == [0, 1, 2]
    (event,) = read_events(str(tmp_path / "plain")).events
    assert event.step == 2, event.step

    m = rankmem.Monitor(out_dir=str(tmp_path / "numbered"), device="cpu", children=False, near_oom_watch=False)
    for it in range(25):
        try:
            with m.step():
                if it == 17:
                    raise MemoryError("boom")
        except MemoryError:
            pass
        if it % 10 == 0:
            m.collect(step=it)
    m.close()
    assert rankmem.offline.read_run(str(tmp_path / "numbered")).steps.tolist() == [0, 10, 20]
    (event,) = read_events(str(tmp_path / "numbered")).events
    assert event.step is None  # the collect count (2) would have been a wrong step


def test_a_recorded_oom_keeps_nothing_of_the_failing_frames_alive(tmp_path: Path) -> None:
    """A caller that catches the OOM and retries smaller (auto_find_batch_size) needs the failing step's
    tensors freed: the event is written, the exception (and through its traceback, the frames) is not kept."""
    import gc
    import weakref

    class Activations:
        pass

    held: list[weakref.ref[Activations]] = []

    def forward() -> None:
        activations = Activations()
        held.append(weakref.ref(activations))
        raise MemoryError("simulated")

    monitor = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", children=False, near_oom_watch=False)
    for step in range(2):
        try:
            with monitor.step(step), monitor.phase("update"):
                forward()
        except MemoryError:
            pass
    gc.collect()
    assert [ref() for ref in held] == [None, None]
    # One event per exception, though each left two windows; two exceptions, two events.
    assert [e.step for e in read_events(str(tmp_path)).events] == [0, 1]
    monitor.close()
