"""What device attribution costs the training thread: a collect's local measurement with the split
(the last NVML split picked up: a few attribute reads) against the same without, in one run.

    python bench/bench_nvml.py [--quick]

FakeCuda + FakeNvml (no GPU needed; the NVML enumeration itself runs on the attribution thread and is
timed on a GPU by scripts/gpu_check.sh). Prints us per ``local_metrics`` call, best of 5 rounds, and
the ratio to the baseline.
"""

from __future__ import annotations

import sys
import time

from rankmem import Monitor
from rankmem.testing import FakeCuda, FakeNvml

MIB = 2**20


def _monitor(with_nvml: bool) -> tuple[Monitor, FakeNvml | None]:
    cuda = FakeCuda()
    nvml = FakeNvml(cuda) if with_nvml else None
    if nvml is not None:
        nvml.add_process(3_999_999, 512 * MIB)
    monitor = Monitor(device_module=cuda, nvml_module=nvml, sinks=(), children=False, leak_check=False,
                      nvml_refresh_s=0.5)
    cuda.set_device(0)
    cuda.malloc(64 * MIB)
    return monitor, nvml


def _round(monitor: Monitor, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        monitor.local_metrics()
    return (time.perf_counter() - start) / n * 1e6


def main(quick: bool) -> None:
    n = 2_000 if quick else 20_000
    base, _ = _monitor(False)
    split, nvml = _monitor(True)
    split.local_metrics()
    time.sleep(0.3)  # the first split lands
    assert "mem/device/foreign_gib" in split.local_metrics(), "no split to pick up"
    best_base = best_split = float("inf")
    for _ in range(5):  # interleaved, so that load hits both alike
        best_base = min(best_base, _round(base, n))
        best_split = min(best_split, _round(split, n))
    print(f"local_metrics without attribution: {best_base:.2f} us/call (1.00x)")
    print(f"local_metrics with the last split:  {best_split:.2f} us/call ({best_split / best_base:.2f}x)")
    assert nvml is not None
    print(f"NVML calls on the measuring thread: "
          f"{sum(1 for _, t in nvml.calls if t == __import__('threading').get_ident())}")
    base.close()
    split.close()


if __name__ == "__main__":
    main("--quick" in sys.argv)
