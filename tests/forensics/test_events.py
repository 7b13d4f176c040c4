"""Event files: whole appended lines, a directory that cannot be written, torn and corrupt lines, and
``oom`` events built from fixed error texts (torch's formats, MemoryError, NPU/XPU equivalents)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from rankmem.core.events import KilledEvent, NearOomEvent, OomEvent
from rankmem.forensics.events import EventWriter, oom_event, oom_where
from rankmem.offline.events import read_events

# The text torch 2.x's CUDA caching allocator raises (c10/cuda/CUDACachingAllocator.cpp).
CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
            "20.56 MiB is free. Including non-PyTorch memory, this process has 79.12 GiB memory in use. Of the "
            "allocated memory 77.50 GiB is allocated by PyTorch, and 1.02 GiB is reserved by PyTorch but "
            "unallocated.\nIf reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


class OutOfMemoryError(RuntimeError):
    """Stands in for torch.OutOfMemoryError: matched by class name, so no torch import is needed."""


class CudaSubclassOOM(OutOfMemoryError):
    pass


def test_writer_appends_whole_lines_with_nan_as_null(tmp_path: Path) -> None:
    writer = EventWriter(str(tmp_path), 3)
    assert not (tmp_path / "events").exists()  # opened on the first event only
    assert writer.write(OomEvent(step=7, phase="update", extra={"x": math.nan, "y": [math.inf, 1.5]}))
    assert writer.write(NearOomEvent(step=8, phase=None, time=123.0))
    writer.close()
    lines = (tmp_path / "events" / "rank3.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 3
    first, second = (json.loads(line) for line in lines[:2])
    assert first["kind"] == "oom" and first["rank"] == 3 and first["x"] is None and first["y"] == [None, 1.5]
    assert isinstance(first["time"], float)
    assert second["time"] == 123.0  # the caller's time is kept


def test_writer_appends_across_writers_and_processes(tmp_path: Path) -> None:
    EventWriter(str(tmp_path), 0).write(OomEvent(step=1))
    pid = os.fork()
    if pid == 0:  # another process appending to the same file (O_APPEND: no line interleaves)
        EventWriter(str(tmp_path), 0).write(NearOomEvent(step=2))
        os._exit(0)
    os.waitpid(pid, 0)
    events = read_events(str(tmp_path))
    assert [e.kind for e in events.events] == ["oom", "near_oom"] and events.corrupt == 0


def test_unwritable_directory_warns_once_and_never_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    writer = EventWriter(str(blocker), 0)  # <file>/events cannot be created, even by root
    with pytest.warns(RuntimeWarning, match=r"cannot write events to .*rank0.jsonl.*training goes on") as caught:
        assert writer.write(OomEvent(step=1)) is False
        assert writer.write(OomEvent(step=2)) is False
    assert len(caught) == 1


def test_unserialisable_figures_are_named_not_fatal(tmp_path: Path) -> None:
    class Scalar:
        def item(self) -> float:
            return 2.5

    writer = EventWriter(str(tmp_path), 0)
    assert writer.write(OomEvent(step=1, extra={"a": Scalar(), "b": object()}))
    event = read_events(str(tmp_path)).events[0]
    assert event.extra["a"] == 2.5 and event.extra["b"].startswith("<object object")


def test_an_event_that_cannot_be_encoded_is_skipped_not_raised(tmp_path: Path) -> None:
    class Exhausted:
        def item(self) -> float:
            raise MemoryError  # what a host OOM can leave behind for the handler

    writer = EventWriter(str(tmp_path), 0)
    with pytest.warns(RuntimeWarning, match=r"cannot encode a 'oom' event \(MemoryError\(\)\); it is skipped"):
        assert writer.write(OomEvent(step=1, extra={"x": Exhausted()})) is False
    assert writer.write(OomEvent(step=2))  # the next one is written
    assert [e.step for e in read_events(str(tmp_path)).events] == [2]


def test_reader_merges_ranks_by_time_and_counts_torn_and_corrupt_lines(tmp_path: Path) -> None:
    events = tmp_path / "events"
    events.mkdir()
    (events / "rank0.jsonl").write_text(
        '{"kind":"oom","rank":0,"step":3,"phase":"update","time":30.0}\n'
        'not json\n'
        '[1, 2]\n'
        '{"kind":"near_oom","rank":0,"step":2,"phase":"rollout","time":10.0}\n'
        '{"kind":"killed","rank":0,"st')  # torn: the process died mid-write
    (events / "rank1.jsonl").write_text('{"kind":"killed","rank":1,"step":2,"phase":null,"time":20.0}\n')
    (events / "other.txt").write_text("ignored\n")
    got = read_events(str(tmp_path))
    assert [(e.rank, e.time) for e in got.events] == [(0, 10.0), (1, 20.0), (0, 30.0)]
    assert [type(e) for e in got.events] == [NearOomEvent, KilledEvent, OomEvent]
    assert got.corrupt == 3
    # The run log's path works as well as its directory.
    (tmp_path / "rankmem.jsonl").write_text("{}\n")
    assert len(read_events(str(tmp_path / "rankmem.jsonl")).events) == 3


def test_reader_without_events_directory(tmp_path: Path) -> None:
    got = read_events(str(tmp_path))
    assert got.events == [] and got.corrupt == 0


@pytest.mark.parametrize(
    ("exc", "where"),
    [
        (MemoryError(), "host"),
        (OutOfMemoryError(CUDA_OOM), "device"),
        (CudaSubclassOOM("x"), "device"),  # a subclass of an OutOfMemory class
        (RuntimeError("NPU out of memory. Tried to allocate 20.00 MiB"), "device"),  # torch_npu
        (OSError(12, "Cannot allocate memory"), "host"),  # ENOMEM: a fork for a DataLoader worker
        (OSError(28, "No space left on device"), None),
        (RuntimeError("Expected all tensors to be on the same device"), None),
        (ValueError("out of memory"), None),  # only RuntimeErrors carry an accelerator's OOM text
    ],
)
def test_oom_where(exc: BaseException, where: str | None) -> None:
    assert oom_where(exc) == where


def test_torchs_own_cpu_allocation_failure_is_a_host_oom() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(RuntimeError) as info:
        torch.empty(1 << 60, dtype=torch.uint8)  # 1 EiB: torch's CPU allocator refuses it
    assert oom_where(info.value) == "host"
    event = oom_event(info.value, 0, 3, "update", {}, None)
    assert event.where == "host" and event.requested_bytes == 1 << 60


def test_oom_event_from_torch_cuda_text() -> None:
    event = oom_event(OutOfMemoryError(CUDA_OOM), 1, 57, "update", {"rss_bytes": 5 << 30},
                      {"allocated_bytes": 77 << 30, "reserved_bytes": 78 << 30})
    assert event.kind == "oom" and event.rank == 1 and event.step == 57 and event.phase == "update"
    assert event.where == "device"
    assert event.requested_bytes == 2 << 30
    assert event.error_total_bytes == round(79.15 * (1 << 30))
    assert event.error_free_bytes == round(20.56 * (1 << 20))
    assert event.error == ("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                              "capacity of 79.15 GiB of which 20.56 MiB is free. Including non-PyTorch memory, this "
                              "process has 79.12 GiB memory in use. Of the allocated memory 77.50 GiB is allocated by "
                              "PyTorch, and 1.02 GiB is reserved by PyTorch but unallocated.")
    assert event.host == {"rss_bytes": 5 << 30} and event.device["reserved_bytes"] == 78 << 30


@pytest.mark.parametrize(
    ("text", "requested"),
    [
        ("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity)", 20 << 20),
        ("Tried to allocate 512 bytes", 512),
        ("Tried to allocate 1.50 KiB", 1536),
        ("XPU out of memory. Tried to allocate 3.00 GiB", 3 << 30),
        ("NPU out of memory. Tried to allocate 64.00 MB", 64 << 20),  # torch_npu's MB means MiB
        ("CUDA error: out of memory", None),  # the driver's error gives no size
    ],
)
def test_requested_size_units(text: str, requested: int | None) -> None:
    assert oom_event(RuntimeError(text), 0, 1, None, {}, None).requested_bytes == requested


def test_host_oom_event_from_memory_error() -> None:
    event = oom_event(MemoryError(), 0, None, None, {"rss_bytes": 1}, None)
    assert event.where == "host" and event.error == "MemoryError"
    assert event.requested_bytes is None and event.device is None and event.step is None
    json.dumps(event.to_json(), allow_nan=False)  # ready for the writer as it is
