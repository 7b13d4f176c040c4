"""Helpers for the device-attribution tests: a Monitor over FakeCuda + FakeNvml, run until it has split."""

from __future__ import annotations

import time
from typing import Any

from rankmem import Monitor
from rankmem.testing import FakeCuda, FakeNvml

MIB = 2**20
KEYS = ("nontorch", "siblings", "descendants", "foreign", "unattributed")


def key(part: str) -> str:
    return f"mem/device/{part}_gib/max"


def run_until_split(monitor: Monitor, nvml: FakeNvml, steps: int = 300, phase: str = "rollout",
                    until: str | None = None) -> dict[str, float]:
    """Steps (a phase each) until the attribution thread has listed processes and a collect followed
    (and ``until``, a key, is in the collect: a split taken inside the phase, for a phase key)."""
    out: dict[str, float] = {}
    listed = 0
    for step in range(steps):
        with monitor.step(step):
            with monitor.phase(phase):
                time.sleep(0.03)  # longer than the fixture's refresh: most splits fall inside the phase
        out = monitor.collect()
        if listed and any(name == "nvmlDeviceGetComputeRunningProcesses" for name, _ in nvml.calls[:listed]):
            if until is None or until in out:
                return out
        listed = len(nvml.calls)
    raise AssertionError(f"no device split after {steps} steps; calls {nvml.calls[:5]}")


def fixture(**nvml_options: Any) -> tuple[FakeCuda, FakeNvml, Monitor]:
    """A device with a 300 MiB context and 1000 MiB reserved by this process's torch."""
    cuda = FakeCuda(context=300 * MIB)
    nvml = FakeNvml(cuda, **nvml_options)
    monitor = Monitor(device_module=cuda, nvml_module=nvml, sinks=(), nvml_refresh_s=0.02, leak_check=False)
    cuda.set_device(0)
    cuda.malloc(1000 * MIB)
    return cuda, nvml, monitor


def mib(out: dict[str, float], part: str) -> float | None:
    value = out.get(key(part))
    return None if value is None else value * 1024
