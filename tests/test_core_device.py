"""The device backend through a faithful fake of torch.cuda, and a CPU-only torch build."""

from __future__ import annotations

import pytest
import torch

import rankmem
from rankmem._device import DeviceBackend, select_backend
from rankmem._units import GIB, MIB
from rankmem.testing import FakeCuda, FakeOutOfMemoryError


def gib(metrics: dict[str, float], key: str) -> int:
    return round(metrics[key] * GIB)


def test_peaks_reset_per_window() -> None:
    cuda = FakeCuda()
    monitor = rankmem.Monitor(sinks=(), device_module=cuda, children=False)
    keep = cuda.malloc(100 * MIB)
    with monitor.step(0):
        spike = cuda.malloc(500 * MIB)
        cuda.free(spike)
    m0 = monitor.local_metrics()
    with monitor.step(1):
        small = cuda.malloc(50 * MIB)
        cuda.free(small)
    m1 = monitor.local_metrics()
    assert gib(m0, "mem/device/allocated_gib") == 100 * MIB
    assert gib(m0, "mem/device/peak_allocated_gib") == 600 * MIB
    assert gib(m1, "mem/device/peak_allocated_gib") == 150 * MIB  # reset: step 0's spike is gone
    # Reserved memory is cached: 600 MiB of segments stay reserved after the free.
    assert gib(m1, "mem/device/reserved_gib") == 600 * MIB
    assert gib(m1, "mem/device/peak_reserved_gib") == 600 * MIB
    assert gib(m1, "mem/device/lifetime_peak_reserved_gib") == 600 * MIB
    cuda.free(keep)


def test_phase_peaks_and_step_peak_is_max_over_phases_and_gaps() -> None:
    cuda = FakeCuda()
    monitor = rankmem.Monitor(sinks=(), device_module=cuda, children=False)
    with monitor.step(0):
        with monitor.phase("rollout"):
            h = cuda.malloc(300 * MIB)
            cuda.free(h)
        gap = cuda.malloc(400 * MIB)  # between phases: belongs to the step only
        cuda.free(gap)
        with monitor.phase("update"):
            kept = cuda.malloc(64 * MIB)
    m = monitor.local_metrics()
    assert gib(m, "mem/phase/rollout/peak_allocated_gib") == 300 * MIB
    assert gib(m, "mem/phase/update/peak_allocated_gib") == 64 * MIB
    assert gib(m, "mem/phase/update/allocated_delta_gib") == 64 * MIB
    assert gib(m, "mem/phase/rollout/allocated_delta_gib") == 0
    assert gib(m, "mem/device/peak_allocated_gib") == 400 * MIB
    cuda.free(kept)


def test_steps_collected_every_n_keep_every_peak() -> None:
    cuda = FakeCuda(total=1 * GIB, context=0)
    monitor = rankmem.Monitor(sinks=(), device_module=cuda, children=False)
    with monitor.step(0):
        spike = cuda.malloc(700 * MIB)
        cuda.free(spike)
    with monitor.step(1):
        with pytest.raises(FakeOutOfMemoryError):  # a retry and an OOM in the second step
            cuda.malloc(2 * GIB)
        kept = cuda.malloc(10 * MIB)
    m = monitor.collect(step=1)
    assert round(m["mem/device/peak_allocated_gib/max"] * GIB) == 700 * MIB  # step 0's peak survives
    assert round(m["mem/device/allocated_gib/max"] * GIB) == 10 * MIB  # current: the last step's
    assert (m["mem/device/alloc_retries/max"], m["mem/device/ooms/max"]) == (1, 1)
    assert monitor.last_record is not None and monitor.last_record.step == 1
    cuda.free(kept)


def test_retry_and_oom_counts_are_window_deltas() -> None:
    cuda = FakeCuda(total=1 * GIB, context=0)
    monitor = rankmem.Monitor(sinks=(), device_module=cuda, children=False)
    with monitor.step(0):
        a = cuda.malloc(600 * MIB)
        cuda.free(a)  # 600 MiB stays cached
        b = cuda.malloc(700 * MIB)  # must free the cache first: one retry
        with pytest.raises(FakeOutOfMemoryError):
            cuda.malloc(600 * MIB)  # 700 + 600 > 1024 even after a retry: retry and OOM
        cuda.free(b)
    m0 = monitor.local_metrics()
    with monitor.step(1):
        pass
    m1 = monitor.local_metrics()
    assert m0["mem/device/alloc_retries"] == 2
    assert m0["mem/device/ooms"] == 1
    assert m1["mem/device/alloc_retries"] == 0  # cumulative counters, reported per window
    assert m1["mem/device/ooms"] == 0


def test_other_and_headroom_arithmetic() -> None:
    cuda = FakeCuda(total=16 * GIB, context=512 * MIB)
    cuda.other_process = 3 * GIB  # a colocated inference engine
    monitor = rankmem.Monitor(sinks=(), device_module=cuda, children=False)
    with monitor.step(0):
        h = cuda.malloc(2 * GIB)
        cuda.free(h)
        kept = cuda.malloc(1 * GIB)
    m = monitor.local_metrics()
    reserved = 2 * GIB  # the 2 GiB segment is cached; the 1 GiB block reuses it
    assert gib(m, "mem/device/reserved_gib") == reserved
    assert gib(m, "mem/device/used_gib") == reserved + 512 * MIB + 3 * GIB
    assert gib(m, "mem/device/other_gib") == 512 * MIB + 3 * GIB
    assert gib(m, "mem/device/total_gib") == 16 * GIB
    assert gib(m, "mem/device/headroom_gib") == 16 * GIB - (2 * GIB + 512 * MIB + 3 * GIB)
    cuda.free(kept)


def test_other_is_clamped_at_zero() -> None:
    class Skewed(FakeCuda):
        def mem_get_info(self, device: object = None) -> tuple[int, int]:
            return self.total, self.total  # the driver reports less used than the allocator holds

    cuda = Skewed()
    h = cuda.malloc(GIB)
    monitor = rankmem.Monitor(sinks=(), device_module=cuda, children=False)
    m = monitor.local_metrics()
    assert m["mem/device/other_gib"] == 0.0
    cuda.free(h)


def test_verl_keys_carry_the_corrected_meaning() -> None:
    cuda = FakeCuda()
    monitor = rankmem.Monitor(sinks=(), device_module=cuda, children=False)
    stale = cuda.malloc(GIB)
    cuda.free(stale)
    with monitor.step(0):  # verl's lifetime max would say 1 GiB; this step peaked at 256 MiB
        h = cuda.malloc(256 * MIB)
        cuda.free(h)
    out = monitor.collect()
    assert round(out["perf/max_memory_allocated_gb"] * GIB) == 256 * MIB
    assert out["perf/max_memory_reserved_gb"] == out["mem/device/peak_reserved_gib/max"]
    assert out["perf/cpu_memory_used_gb"] == out["mem/host/rss_gib/max"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only torch build")
def test_cpu_only_torch_reports_device_figures_unavailable() -> None:
    assert select_backend("auto") is None  # nothing available: no backend, no device keys
    # Forcing the real torch.cuda on a CPU build: every figure is None, not 0, and nothing raises.
    backend = select_backend("cuda")
    assert isinstance(backend, DeviceBackend)
    backend.reset_peaks()
    reading = backend.read()
    assert all(getattr(reading, f) is None for f in reading.__dataclass_fields__)
    monitor = rankmem.Monitor(sinks=(), device="cuda", children=False)
    with monitor.step(0):
        pass
    m = monitor.collect()
    assert monitor.device_backend == "cuda"
    assert not any(k.startswith("mem/device/") for k in m)
    assert "perf/max_memory_allocated_gb" not in m and "perf/cpu_memory_used_gb" in m
    assert m["mem/host/rss_gib/max"] > 0


def test_uninitialised_backend_creates_no_context() -> None:
    class Lazy(FakeCuda):
        initialised = False
        touched = 0

        def is_initialized(self) -> bool:
            return self.initialised

        def mem_get_info(self, device: object = None) -> tuple[int, int]:
            self.touched += 1  # on real CUDA this would create a context on the current device
            return super().mem_get_info(device)

        def reset_peak_memory_stats(self, device: object = None) -> None:
            self.touched += 1
            super().reset_peak_memory_stats(device)

    cuda = Lazy()
    monitor = rankmem.Monitor(sinks=(), device_module=cuda, children=False)
    before = monitor.local_metrics()
    assert cuda.touched == 0 and "mem/device/used_gib" not in before
    cuda.initialised = True  # the training loop's first CUDA call
    after = monitor.local_metrics()
    assert cuda.touched > 0 and after["mem/device/total_gib"] == 16.0


def test_unknown_device_is_a_clear_error() -> None:
    with pytest.raises(rankmem.RankmemError, match="device must be one of"):
        rankmem.Monitor(sinks=(), device="tpu")

