"""rankmem.testing.FakeCuda against what torch.cuda does (torch/cuda/__init__.py, memory.py, the allocator)."""

from __future__ import annotations

import re

import pytest

from rankmem.core.units import GIB, MIB
from rankmem.testing import FakeCuda, FakeOutOfMemoryError


def test_lazy_initialisation() -> None:
    cuda = FakeCuda(devices=2)
    assert cuda.device_count() == 2  # counting devices initialises nothing
    assert cuda.memory_stats() == {} and cuda.memory_stats_as_nested_dict(1) == {}
    assert cuda.memory_allocated() == 0 and cuda.max_memory_reserved(0) == 0
    cuda.empty_cache()
    assert not cuda.is_initialized()
    with pytest.raises(RuntimeError, match=r"^Invalid device argument 1: did you call init\?$"):
        cuda.reset_peak_memory_stats(1)
    assert not cuda.is_initialized()
    cuda.reset_peak_memory_stats()  # no device: current_device() initialises first, as in torch
    assert cuda.is_initialized() and cuda.contexts_created == {}


@pytest.mark.parametrize("first_call", ["init", "current_device", "get_device_name", "memory_stats_after_init"])
def test_calls_that_initialise_without_a_context(first_call: str) -> None:
    cuda = FakeCuda()
    if first_call == "memory_stats_after_init":
        cuda.init()
        assert cuda.memory_stats()["num_ooms"] == 0
    else:
        getattr(cuda, first_call)()
    assert cuda.is_initialized() and cuda.contexts_created == {} and not cuda._has_primary_context(0)


def test_calls_that_create_a_context() -> None:
    cuda = FakeCuda(devices=3, context=500 * MIB)
    free, total = cuda.mem_get_info(2)
    assert cuda.contexts_created == {2: 1} and total - free == 500 * MIB  # the context it created
    cuda.set_device(1)
    assert cuda.current_device() == 1 and cuda.contexts_created == {1: 1, 2: 1}
    cuda.mem_get_info(1)
    cuda.set_device(1)
    assert cuda.contexts_created == {1: 1, 2: 1}  # one primary context per device
    h = cuda.malloc(MIB, device=0)
    assert cuda.contexts_created == {0: 1, 1: 1, 2: 1} and cuda.memory_allocated(0) == MIB
    assert cuda.memory_allocated(1) == 0  # per-device allocators
    cuda.free(h)
    with pytest.raises(RuntimeError, match="device_index=3"):
        cuda._has_primary_context(3)


def test_stats_have_torchs_shape() -> None:
    cuda = FakeCuda()
    small = cuda.malloc(1000)  # rounded to 1024 bytes in a 2 MiB small-pool segment
    large = cuda.malloc(100 * MIB)
    flat = cuda.memory_stats()
    assert len(flat) > 110 and list(flat) == sorted(flat)  # ~120 keys, as on a real GPU
    assert flat["allocated_bytes.all.current"] == 1024 + 100 * MIB
    assert flat["allocated_bytes.small_pool.current"] == 1024
    assert flat["reserved_bytes.small_pool.current"] == 2 * MIB
    assert flat["inactive_split_bytes.all.current"] == 2 * MIB - 1024
    assert flat["requested_bytes.all.current"] == 1000 + 100 * MIB
    assert flat["segment.all.current"] == 2 and flat["num_device_alloc"] == 2
    nested = cuda.memory_stats_as_nested_dict(0)
    assert nested["allocated_bytes"]["all"]["current"] == flat["allocated_bytes.all.current"]
    cuda.free(large)
    cuda.reset_peak_memory_stats(0)
    assert cuda.max_memory_allocated() == 1024 and cuda.max_memory_reserved() == 2 * MIB + 100 * MIB
    cuda.free(small)
    cuda.empty_cache()
    assert cuda.memory_reserved() == 0 and cuda.memory_stats()["num_device_free"] == 2


def test_segment_sizes_follow_torchs_rounding() -> None:
    cuda = FakeCuda()
    sizes = {}
    for n in (100, MIB, MIB + 1, 9 * MIB, 10 * MIB + 1):
        cuda.empty_cache()
        h = cuda.malloc(n)
        sizes[n] = cuda.memory_reserved()
        cuda.free(h)
    assert sizes == {100: 2 * MIB, MIB: 2 * MIB, MIB + 1: 20 * MIB, 9 * MIB: 20 * MIB, 10 * MIB + 1: 12 * MIB}


def test_oom_takes_torchs_path() -> None:
    cuda = FakeCuda(total=4 * GIB, context=512 * MIB)
    cuda.other_process = 1 * GIB
    seen: list[tuple[tuple[int, int, int, int], int]] = []
    cuda._attach_out_of_memory_observer(lambda *a: seen.append((a, 0)))  # before init: lost, as in torch
    kept = cuda.malloc(1 * GIB)
    cuda.free(cuda.malloc(512 * MIB))  # cached: released by the retry
    cuda._record_memory_history(enabled="all", context="all", stacks="python", max_entries=100)
    cuda._attach_out_of_memory_observer(lambda *a: seen.append((a, cuda.memory_stats()["num_ooms"])))
    with pytest.raises(FakeOutOfMemoryError) as err:
        cuda.malloc(2 * GIB)
    free = 4 * GIB - 512 * MIB - 1 * GIB - 1 * GIB
    # torch writes exactly 1 GiB as 1024.00 MiB (format_size: up to 2**30 bytes in MiB).
    # Called before the raise, after num_ooms counted it; the third argument is the capacity.
    assert seen == [((0, 2 * GIB, 4 * GIB, free), 1)]
    assert isinstance(err.value, RuntimeError)
    assert re.fullmatch(
        r"CUDA out of memory\. Tried to allocate 2\.00 GiB\. GPU 0 has a total capacity of 4\.00 GiB of which "
        r"1\.50 GiB is free\. Process \d+ has 1024\.00 MiB memory in use\. Including non-PyTorch memory, this "
        r"process has 1\.50 GiB memory in use\. Of the allocated memory 1024\.00 MiB is allocated by PyTorch, and "
        r"0 bytes is reserved by PyTorch but unallocated\. If reserved but unallocated memory is large .*",
        str(err.value),
    )
    stats = cuda.memory_stats()
    assert (stats["num_alloc_retries"], stats["num_ooms"]) == (1, 1)
    traces = cuda._snapshot()["device_traces"][0]
    oom = next(e for e in traces if e["action"] == "oom")
    assert oom["size"] == 2 * GIB and oom["device_free"] == free and "addr" not in oom
    assert any(f["name"] == "test_oom_takes_torchs_path" for f in oom["frames"])
    cuda.free(kept)


def test_history_is_a_bounded_ring_kept_only_after_init() -> None:
    cuda = FakeCuda()
    cuda._record_memory_history(max_entries=3)  # before init: lost
    cuda.init()
    assert cuda._snapshot()["device_traces"] == [[]]
    cuda._record_memory_history(max_entries=3)
    for _ in range(3):
        cuda.free(cuda.malloc(MIB))
    traces = cuda._snapshot()["device_traces"][0]
    # The last 3: a snapshot taken while recording marks itself in the ring, as torch's does.
    assert [e["action"] for e in traces] == ["free_requested", "free_completed", "snapshot"]
    assert (traces[-1]["size"], traces[-1]["frames"]) == (0, [])
    cuda._record_memory_history(enabled=None)
    cuda.malloc(MIB)
    assert cuda._snapshot()["device_traces"] == [[]]


def test_snapshot_segments_have_torchs_fields() -> None:
    cuda = FakeCuda()
    assert cuda._snapshot() == {"segments": [], "device_traces": []}  # before init
    cuda._record_memory_history(enabled="all")  # lost: nothing initialised yet
    h = cuda.malloc(5 * MIB)
    (segment,) = cuda._snapshot()["segments"]
    assert segment.keys() >= {
        "device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
        "segment_type", "segment_pool_id", "blocks",
    }
    assert (segment["total_size"], segment["allocated_size"], segment["segment_type"]) == (20 * MIB, 5 * MIB, "large")
    assert [(b["state"], b["size"]) for b in segment["blocks"]] == [("active_allocated", 5 * MIB), ("inactive",
                                                                                                    15 * MIB)]
    assert cuda.memory_snapshot() == [segment]
    cuda.free(h)
