"""The real CUDA path, against ground truth: run by scripts/gpu_check.sh on a machine with a GPU.

    pytest -m gpu tests/test_gpu.py

Deselected by default (``-m 'not gpu'`` in pyproject); each test also skips itself without CUDA.
"""

from __future__ import annotations

import pytest
import torch

import rankmem
from rankmem._device import select_backend
from rankmem._units import GIB, MIB

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_auto_picks_cuda_and_reads_real_figures() -> None:
    backend = select_backend("auto")
    assert backend is not None and backend.name == "cuda"
    r = backend.read()
    assert r.total == torch.cuda.mem_get_info()[1]
    assert r.used is not None and r.reserved is not None and r.used >= r.reserved
    assert r.allocated == torch.cuda.memory_allocated()


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


def test_memory_outside_the_allocator_shows_as_other() -> None:
    monitor = rankmem.Monitor(sinks=(), device="cuda", children=False)
    before = monitor.local_metrics()["mem/device/other_gib"]
    # Memory the caching allocator does not see, like a colocated engine's own pool.
    import ctypes

    cudart = ctypes.CDLL("libcudart.so") if _has_cudart() else None
    if cudart is None:
        pytest.skip("libcudart.so not loadable to allocate outside torch")
    ptr = ctypes.c_void_p()
    assert cudart.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(256 * MIB)) == 0
    try:
        after = monitor.local_metrics()["mem/device/other_gib"]
        assert abs((after - before) * GIB - 256 * MIB) < 4 * MIB
    finally:
        cudart.cudaFree(ptr)


def _has_cudart() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcudart.so")
    except OSError:
        return False
    return True


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
