"""The device backend through a faithful fake of torch.cuda, and a CPU-only torch build."""

from __future__ import annotations

import pytest
import torch

import rankmem
from rankmem.core.records import DeviceReading
from rankmem.core.units import GIB, MIB
from rankmem.probe.device import DeviceBackend, select_backend
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
    assert all(getattr(reading, f) is None for f in FIGURES)
    monitor = rankmem.Monitor(sinks=(), device="cuda", children=False)
    with monitor.step(0):
        pass
    m = monitor.collect()
    assert monitor.device_backend == "cuda"
    assert not any(k.startswith("mem/device/") for k in m)
    assert "perf/max_memory_allocated_gb" not in m and "perf/cpu_memory_used_gb" in m
    assert m["mem/host/rss_gib/max"] > 0


# ---- lazy CUDA: nothing here may initialise CUDA or create a context ---------------------------------

FIGURES = [f for f in DeviceReading.__dataclass_fields__ if f != "before_init"]


def test_building_a_monitor_creates_no_context() -> None:
    cuda = FakeCuda()
    monitor = rankmem.Monitor(sinks=(), device_module=cuda, children=False)
    with monitor.step(0):
        pass
    before = monitor.collect()  # the first collect gathers the header (device name) too
    assert cuda.contexts_created == {} and not cuda.is_initialized()
    assert not any(k.startswith("mem/device/") for k in before)  # absent, not 0
    assert monitor.header is not None and monitor.header.ranks[0].device == "cuda"
    cuda.set_device(0)  # the training loop's first CUDA call
    after = monitor.collect()
    assert after["mem/device/total_gib/max"] == 16.0
    assert cuda.contexts_created == {0: 1}  # the one set_device made


def test_a_read_before_init_is_all_none() -> None:
    cuda = FakeCuda()
    backend = select_backend("cuda", cuda)
    assert backend is not None
    backend.reset_peaks()  # torch raises "did you call init?" here; rankmem must not call it
    reading = backend.read()
    assert all(getattr(reading, f) is None for f in FIGURES) and reading.before_init
    assert backend.device_name() == "cuda" and backend.segments() == []
    assert not cuda.is_initialized() and cuda.contexts_created == {}
    # Initialised but without a context on the current device: mem_get_info would create one.
    cuda.init()
    assert backend.read().before_init and cuda.contexts_created == {}
    h = cuda.malloc(MIB)
    reading = backend.read()
    assert not reading.before_init and reading.allocated == MIB and reading.total == 16 * GIB
    assert backend.device_name() == "cuda:0 Fake GPU"
    cuda.free(h)


def test_reads_follow_the_current_device() -> None:
    cuda = FakeCuda(devices=2)
    monitor = rankmem.Monitor(sinks=(), device_module=cuda, children=False)
    cuda.set_device(1)  # after the Monitor was built, as in most scripts
    with monitor.step(0):
        h = cuda.malloc(256 * MIB)
    m = monitor.local_metrics()
    assert gib(m, "mem/device/allocated_gib") == 256 * MIB
    assert gib(m, "mem/device/used_gib") == 256 * MIB + cuda.context
    assert cuda.contexts_created == {1: 1}  # nothing on device 0, the other rank's GPU
    cuda.free(h)


def test_a_window_opened_before_init_counts_its_oom() -> None:
    cuda = FakeCuda(total=1 * GIB, context=0)
    monitor = rankmem.Monitor(sinks=(), device_module=cuda, children=False)
    with monitor.step(0):  # opened before any CUDA call: its start reads nothing
        with monitor.phase("update"):
            with pytest.raises(FakeOutOfMemoryError):
                cuda.malloc(2 * GIB)
            h = cuda.malloc(64 * MIB)
    m = monitor.local_metrics()
    assert (m["mem/device/ooms"], m["mem/device/alloc_retries"]) == (1, 1)
    assert gib(m, "mem/phase/update/allocated_delta_gib") == 64 * MIB
    cuda.free(h)


def test_nested_and_flat_stats_read_alike() -> None:
    class FlatOnly(FakeCuda):  # an npu/xpu-like module without the nested form
        memory_stats_as_nested_dict = None  # type: ignore[assignment]

        def memory_stats(self, device: object = None) -> dict[str, object]:
            return _flat(FakeCuda.memory_stats_as_nested_dict(self, device))

    readings = []
    for cuda in (FakeCuda(), FlatOnly()):
        a = cuda.malloc(5 * MIB)  # a 20 MiB segment: 15 MiB of it an inactive split block
        b = cuda.malloc(300 * MIB)
        cuda.free(b)
        readings.append(select_backend("cuda", cuda).read())  # type: ignore[union-attr]
        cuda.free(a)
    assert readings[0] == readings[1]
    r = readings[0]
    assert (r.allocated, r.reserved, r.peak_allocated) == (5 * MIB, 320 * MIB, 305 * MIB)
    assert r.inactive_split == 15 * MIB and r.free == r.total - r.used  # type: ignore[operator]


def _flat(nested: dict[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in nested.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


# ---- forensics helpers: no-ops before init, torch's behaviour after --------------------------------

def test_oom_observer_attached_only_after_init() -> None:
    cuda = FakeCuda(total=1 * GIB, context=100 * MIB)
    backend = select_backend("cuda", cuda)
    assert backend is not None
    calls: list[tuple[int, int, int, int]] = []
    assert backend.attach_oom_observer(lambda *a: calls.append(a)) is False  # pytorch#107330
    assert not cuda.is_initialized()
    cuda.init()
    assert backend.attach_oom_observer(lambda *a: calls.append(a)) is True
    with pytest.raises(FakeOutOfMemoryError):
        cuda.malloc(2 * GIB)
    assert calls == [(0, 2 * GIB, 1 * GIB, 1 * GIB - 100 * MIB)]  # once: the first observer was never kept


def test_history_snapshot_and_segments() -> None:
    cuda = FakeCuda()
    backend = select_backend("cuda", cuda)
    assert backend is not None
    assert backend.record_history(100) is False and backend.snapshot() is None  # not initialised
    cuda.init()
    assert backend.record_history(100) is True
    big, small = cuda.malloc(512 * MIB), cuda.malloc(4 * MIB)
    snap = backend.snapshot()
    assert snap is not None and [e["action"] for e in snap["device_traces"][0]][:2] == ["segment_alloc", "alloc"]
    top = backend.segments(top=1)
    assert len(top) == 1 and top[0]["allocated_size"] == 512 * MIB and top[0]["total_size"] == 512 * MIB
    assert "test_history_snapshot_and_segments" in top[0]["largest_block_frames"][0]
    assert [s["allocated_size"] for s in backend.segments()] == [512 * MIB, 4 * MIB]
    assert backend.record_history(0) is True  # stops
    cuda.free(big)
    cuda.free(small)


def test_unknown_device_is_a_clear_error() -> None:
    with pytest.raises(rankmem.RankmemError, match="device must be one of"):
        rankmem.Monitor(sinks=(), device="tpu")



def test_inactive_split_comes_from_the_same_stats_read() -> None:
    cuda = FakeCuda()
    monitor = rankmem.Monitor(sinks=(), device_module=cuda, children=False)
    with monitor.step(0):
        small = cuda.malloc(1000)  # a 512-byte-rounded block in a 2 MiB small-pool segment
        mid = cuda.malloc(3 * MIB)  # 3 MiB in use of a 20 MiB segment
    m = monitor.local_metrics()
    assert gib(m, "mem/device/inactive_split_gib") == (2 * MIB - 1024) + (20 * MIB - 3 * MIB)
    assert gib(m, "mem/device/reserved_gib") - gib(m, "mem/device/allocated_gib") == gib(m,
                                                                                         "mem/device/inactive_split_gib")
    assert "mem/host/pinned_gib" not in m  # this module has no host allocator stats: absent, never 0
    cuda.free(small)
    cuda.free(mid)


# torch.cuda's pinned (host) allocator stats in the shape _cuda_hostMemoryStats() returns (the keys of
# torch/cuda/memory.py's host_memory_stats docstring).
HOST_STATS: dict[str, object] = {
    "allocations": {"current": 3, "peak": 5, "allocated": 9, "freed": 6},
    "allocated_bytes": {"current": 3 * GIB, "peak": 7 * GIB, "allocated": 12 * GIB, "freed": 9 * GIB},
    "active_requests": {"current": 1, "peak": 4, "allocated": 40, "freed": 39},
    "active_bytes": {"current": 1 * GIB, "peak": 6 * GIB, "allocated": 50 * GIB, "freed": 49 * GIB},
    "num_host_alloc": 9, "num_host_free": 6,
    "host_alloc_time": {"total": 900, "max": 300, "min": 20, "count": 9, "avg": 100},
    "host_free_time": {"total": 60, "max": 20, "min": 5, "count": 6, "avg": 10},
}


def test_pinned_figures_from_torchs_host_stats_nested_or_flat() -> None:
    from rankmem.probe.device import pinned_figures

    # Pinned is everything the host allocator holds (cached blocks stay page-locked), not just active.
    assert pinned_figures(HOST_STATS) == (3 * GIB, 7 * GIB)
    flat = {"allocated_bytes.current": 3 * GIB, "allocated_bytes.peak": 7 * GIB, "active_bytes.current": GIB}
    assert pinned_figures(flat) == (3 * GIB, 7 * GIB)
    assert pinned_figures({}) == (None, None)  # a torch whose host stats lack the figure
    assert pinned_figures({"allocated_bytes": {"current": 5}}) == (5, None)


def test_pinned_memory_reaches_the_metrics_where_the_module_has_host_stats() -> None:
    class WithHostStats(FakeCuda):  # a module offering torch's host-allocator stats under its public name
        def host_memory_stats_as_nested_dict(self) -> dict[str, object]:
            return HOST_STATS

    cuda = WithHostStats()
    monitor = rankmem.Monitor(sinks=(), device_module=cuda, children=False)
    with monitor.step(0):
        h = cuda.malloc(MIB)
    m = monitor.local_metrics()
    assert gib(m, "mem/host/pinned_gib") == 3 * GIB
    assert gib(m, "mem/host/lifetime_peak_pinned_gib") == 7 * GIB
    cuda.free(h)
