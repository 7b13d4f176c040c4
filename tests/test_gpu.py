"""The real CUDA path, against ground truth: run by scripts/gpu_check.sh on a machine with a GPU.

    pytest -m gpu -o addopts="" tests/test_gpu.py

Deselected by default (``-m 'not gpu'`` in pyproject); each test also skips itself without CUDA.
Each test may run alone (gpu_check.sh runs some in their own process): none relies on another having
initialised CUDA.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

import rankmem
from rankmem.core.units import GIB, MIB
from rankmem.probe.device import select_backend
from tests.conftest import REPO, free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_a_fresh_process_creates_no_context_before_its_first_cuda_call() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests/dist_scripts/gpu_fresh_process.py")],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]


def test_auto_picks_cuda_and_reads_real_figures() -> None:
    backend = select_backend("auto")
    assert backend is not None and backend.name == "cuda"
    # The read needs a context on the current device; this test makes its own, whatever ran before.
    torch.cuda.set_device(0)
    x = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    r = backend.read()
    free, total = torch.cuda.mem_get_info()
    stats = torch.cuda.memory_stats()
    assert r.total == total and r.free is not None and abs(r.free - free) < 64 * MIB
    assert r.used is not None and r.reserved is not None and r.used >= r.reserved
    assert r.allocated == torch.cuda.memory_allocated() and r.reserved == torch.cuda.memory_reserved()
    assert r.inactive_split == stats["inactive_split_bytes.all.current"]
    assert (r.alloc_retries, r.ooms) == (stats["num_alloc_retries"], stats["num_ooms"])
    del x


def test_pinned_host_memory_and_inactive_split_against_torch() -> None:
    if not hasattr(torch._C, "_cuda_hostMemoryStats"):
        pytest.skip("this torch has no host-allocator stats")
    monitor = rankmem.Monitor(sinks=(), device="cuda", children=False)
    torch.cuda.set_device(0)
    with monitor.step(0):
        pinned = torch.empty(96 * MIB, dtype=torch.uint8, pin_memory=True)
        small = torch.empty(1000, dtype=torch.uint8, device="cuda")  # a split block in a small segment
        torch.cuda.synchronize()
    m = monitor.local_metrics()
    stats = torch.cuda.host_memory_stats()
    assert round(m["mem/host/pinned_gib"] * GIB) == stats["allocated_bytes.current"] >= 96 * MIB
    assert round(m["mem/host/lifetime_peak_pinned_gib"] * GIB) == stats["allocated_bytes.peak"]
    inactive = torch.cuda.memory_stats()["inactive_split_bytes.all.current"]
    assert round(m["mem/device/inactive_split_gib"] * GIB) == inactive
    del pinned, small
    monitor.close()


def test_window_peaks_against_real_allocations() -> None:
    monitor = rankmem.Monitor(sinks=(), device="cuda", children=False)
    keep = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for n_mib in (512, 128):  # the second step proves the reset
        with monitor.step(n_mib):
            with monitor.phase("rollout"):
                spike = torch.empty(n_mib * MIB, dtype=torch.uint8, device="cuda")
                del spike
        m = monitor.local_metrics()
        assert round(m["mem/phase/rollout/peak_allocated_gib"] * GIB) == base + n_mib * MIB
        assert round(m["mem/device/allocated_gib"] * GIB) == base
        assert m["mem/device/peak_reserved_gib"] >= m["mem/device/peak_allocated_gib"]
        assert m["mem/device/other_gib"] > 0  # the CUDA context at least
        headroom = m["mem/device/total_gib"] - (m["mem/device/peak_reserved_gib"] + m["mem/device/other_gib"])
        assert m["mem/device/headroom_gib"] == pytest.approx(headroom)
    del keep


def _malloc_outside_torch(nbytes: int) -> Callable[[], None]:
    """Allocate ``nbytes`` on the current device behind torch's allocator; returns the free.

    Through the CUDA runtime torch already loaded (a pip torch ships ``libcudart.so.<major>``, not
    ``libcudart.so``; dlopen of the soname finds the loaded copy), else the driver API of
    ``libcuda.so.1`` in the context torch made current.
    """
    major = (torch.version.cuda or "").split(".")[0]
    candidates = [f"libcudart.so.{major}"] if major else []
    for path in sys.path:  # the nvidia-cuda-runtime wheel, if dlopen's search path misses it
        candidates += sorted(glob.glob(os.path.join(path, "nvidia", "**", f"libcudart.so.{major}*"), recursive=True))
    for name in candidates:
        try:
            cudart = ctypes.CDLL(name)
        except OSError:
            continue
        ptr = ctypes.c_void_p()
        assert cudart.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)) == 0, f"cudaMalloc via {name}"
        return lambda: cudart.cudaFree(ptr)
    driver: Any = ctypes.CDLL("libcuda.so.1")
    dptr = ctypes.c_uint64()
    assert driver.cuMemAlloc_v2(ctypes.byref(dptr), ctypes.c_size_t(nbytes)) == 0, "cuMemAlloc_v2"
    return lambda: driver.cuMemFree_v2(dptr)


def test_memory_outside_the_allocator_shows_as_other() -> None:
    monitor = rankmem.Monitor(sinks=(), device="cuda", children=False)
    torch.ones(1, device="cuda")  # a context, so that the first read has figures
    before = monitor.local_metrics()["mem/device/other_gib"]
    free = _malloc_outside_torch(256 * MIB)  # like a colocated engine's own pool
    try:
        after = monitor.local_metrics()["mem/device/other_gib"]
        assert abs((after - before) * GIB - 256 * MIB) < 4 * MIB
    finally:
        free()


def test_oom_is_counted_in_its_window() -> None:
    monitor = rankmem.Monitor(sinks=(), device="cuda", children=False)
    with monitor.step(0):
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(4 * torch.cuda.mem_get_info()[1], dtype=torch.uint8, device="cuda")
    m = monitor.local_metrics()
    assert m["mem/device/ooms"] == 1
    with monitor.step(1):
        pass
    assert monitor.local_metrics()["mem/device/ooms"] == 0


def test_a_real_oom_in_a_phase_is_an_event_with_a_snapshot(tmp_path: Any) -> None:
    import json

    torch.ones(1, device="cuda")  # CUDA initialised: the observer and history attach at the next edge
    monitor = rankmem.Monitor(out_dir=str(tmp_path), device="cuda", children=False, oom_history=10_000,
                              near_oom_watch=False)
    kept = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    total = torch.cuda.mem_get_info()[1]
    with pytest.raises(torch.OutOfMemoryError):
        with monitor.step(3), monitor.phase("update"):
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    monitor.close()
    lines = (tmp_path / "events" / "rank0.jsonl").read_text().splitlines()
    event, anatomy = (json.loads(line) for line in lines)
    assert (event["kind"], event["step"], event["phase"], event["where"]) == ("oom", 3, "update", "device")
    assert event["requested_bytes"] >= 2 * total * 0.99 and event["device"]["total_bytes"] == total
    assert event["device"]["top_segments"][0]["allocated_size"] >= 256 * MIB
    assert os.path.getsize(event["snapshot"]) > 0
    # The snapshot replayed: the live set as the allocation failed, 'kept' (from before the ring) on top.
    assert (anatomy["kind"], anatomy["source"], anatomy["instant"]) == ("anatomy", "oom", "oom")
    assert anatomy["step"] == 3
    assert anatomy["requested_bytes"] >= 2 * total * 0.99
    assert anatomy["top"][0][0] == "pre_window" and anatomy["top"][0][2] == 256 * MIB
    assert anatomy["peak_bytes"] == event["device"]["allocated_bytes"]
    del kept


def test_forensics_hooks_behave_as_the_fake_models_them() -> None:
    """What rankmem.testing.FakeCuda claims about torch: the observer's arguments, the message, history."""
    backend = select_backend("cuda")
    assert backend is not None
    torch.ones(1, device="cuda")
    calls: list[tuple[int, ...]] = []
    assert backend.attach_oom_observer(lambda *args: calls.append(args))
    total = torch.cuda.mem_get_info()[1]
    with pytest.raises(torch.OutOfMemoryError) as err:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    assert len(calls) == 1
    device, alloc, third, free = calls[0]
    assert device == torch.cuda.current_device() and alloc >= 2 * total and third == total and 0 < free < total
    assert re.match(r"CUDA out of memory\. Tried to allocate \S+ \w+\. GPU \d+ has a total capacity of ",
                    str(err.value))
    assert backend.record_history(1000)
    try:
        kept = torch.empty(300 * MIB, dtype=torch.uint8, device="cuda")
        snap = backend.snapshot()
        assert snap is not None and snap["device_traces"] and any(
            e["action"] == "alloc" and e["frames"] for e in snap["device_traces"][torch.cuda.current_device()]
        )
        top = backend.segments(top=3)
        assert top and top[0]["allocated_size"] >= 300 * MIB
        assert any("test_forensics_hooks" in f for f in top[0]["largest_block_frames"])
        del kept
    finally:
        backend.record_history(0)


def test_one_rank_nccl_group_gathers_on_the_device() -> None:
    """NCCL accepts the gather's tensors on the current device. One GPU holds one NCCL rank, and
    rankmem skips the collective in a world of one, so the gather is driven past that check."""
    import torch.distributed as dist

    from rankmem.exchange.packed import PackedGather

    monitor = rankmem.Monitor(sinks=(), device="cuda", children=False)  # before set_device, as scripts do
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        gather: PackedGather = monitor._exchange.packed
        gather._world, gather._backend = 1, str(dist.get_backend())  # what _setup does in a larger world
        gather._follow_device()
        assert gather._device == torch.device("cuda", 0)
        for _ in range(2):  # the first call learns the layout (pickled), the second is the tensor path
            layouts, rows = gather.gather(("a", "b"), [1.5, 2.5])
        assert layouts == [("a", "b")] and rows[0].tolist() == [1.5, 2.5]
        assert gather._out.device == torch.device("cuda", 0) and gather.fallbacks == 1
    finally:
        dist.destroy_process_group()
