"""Sampled step windows through the Monitor on a fake CUDA device (rankmem.testing.FakeCuda keeps torch's
history format): which steps are sampled, the anatomy event each writes, and the history left as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

import rankmem
from rankmem.core.units import GIB, MIB
from rankmem.offline.events import read_events
from rankmem.testing import FakeCuda


def _monitor(tmp_path: Path, cuda: FakeCuda, **options: object) -> rankmem.Monitor:
    return rankmem.Monitor(out_dir=str(tmp_path), device_module=cuda, children=False, near_oom_watch=False,
                           nvml_refresh_s=None, **options)


def _work(cuda: FakeCuda, mib: int) -> None:
    """A step's allocations: ``mib`` MiB at its peak, all freed by its end."""
    a = cuda.malloc(mib * MIB // 2)
    b = cuda.malloc(mib * MIB // 2)  # the peak
    cuda.free(a)
    cuda.free(cuda.malloc(MIB))
    cuda.free(b)


def test_every_second_step_is_replayed_into_an_event_with_its_exact_peak(tmp_path: Path) -> None:
    cuda = FakeCuda(total=16 * GIB)
    held = cuda.malloc(100 * MIB)  # live before and through every window
    monitor = _monitor(tmp_path, cuda, anatomy_every=2)
    peaks = {}
    for step in range(4):
        with monitor.step(step):
            with monitor.phase("update"):
                _work(cuda, 64 * (step + 1))
        peaks[step] = monitor.local_metrics()["mem/device/peak_allocated_gib"] * GIB
        assert cuda._snapshot()["device_traces"] == [[]]  # the history is off again between samples
    monitor.close()
    events = read_events(str(tmp_path)).events
    assert [(e.kind, e.step, e.extra["source"]) for e in events] == [("anatomy", 1, "sample"),
                                                                      ("anatomy", 3, "sample")]
    for e in events:
        found = e.extra
        assert found["peak_bytes"] == peaks[e.step] == 100 * MIB + 64 * (e.step + 1) * MIB  # to the byte
        assert found["baseline_bytes"] == 100 * MIB and found["categories"]["pre_window"] == 100 * MIB
        half = 32 * (e.step + 1) * MIB
        assert found["categories"]["temporaries"] == 2 * half
        temps = [h for h in found["top"] if h[0] == "temporaries"]  # by line: the halves, not the freed MiB
        assert [(h[1].split(":")[0], h[2], h[3]) for h in temps] == [("_work@test_sampler.py", half, 1)] * 2
    cuda.free(held)


def test_a_request_and_a_peak_over_the_share_sample_the_next_step_only(tmp_path: Path) -> None:
    cuda = FakeCuda(total=4 * GIB, context=0)
    monitor = _monitor(tmp_path, cuda, anatomy_share=0.5)
    plan = {0: 16, 1: 16, 2: 3 * 1024, 3: 16, 4: 16, 5: 16}  # step 2 peaks at 75% of the device
    for step, mib in plan.items():
        if step == 4:
            monitor.request_anatomy()
        with monitor.step(step):
            _work(cuda, mib)
        monitor.collect()
    monitor.close()
    assert [e.step for e in read_events(str(tmp_path)).events] == [3, 4]


def test_an_oom_in_a_sampled_step_is_the_replays_instant_and_the_run_goes_on(tmp_path: Path) -> None:
    cuda = FakeCuda(total=1 * GIB, context=0)
    cuda.init()  # history can be recorded once CUDA is initialised, as in torch
    monitor = _monitor(tmp_path, cuda, anatomy_every=1)
    with pytest.raises(rankmem.testing.FakeOutOfMemoryError):
        with monitor.step(0):
            kept = cuda.malloc(600 * MIB)
            cuda.malloc(600 * MIB)
    cuda.free(kept)
    with monitor.step(1):
        _work(cuda, 8)
    monitor.close()
    oom, sample, after = read_events(str(tmp_path)).events
    assert oom.kind == "oom" and sample.kind == "anatomy" and after.step == 1
    assert (sample.step, sample.extra["instant"], sample.extra["requested_bytes"]) == (0, "oom", 600 * MIB)
    top = sample.extra["top"][0]
    assert top[2] == 600 * MIB and "test_an_oom_in_a_sampled_step" in top[1]


def test_bad_anatomy_options_are_one_clear_error() -> None:
    with pytest.raises(rankmem.RankmemError, match="anatomy_every must be a whole number >= 0, got -1"):
        rankmem.MonitorConfig(anatomy_every=-1)
    with pytest.raises(rankmem.RankmemError, match=r"anatomy_share must be a share of capacity in \(0, 1\]"):
        rankmem.MonitorConfig(anatomy_share=1.5)
