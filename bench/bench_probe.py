"""Host probe cost per call, against psutil baselines measured in the same run.

    python bench/bench_probe.py

Prints microseconds per call and the ratio to ``psutil.Process().memory_info()``. The target is the
window pair (current RSS + window peak, with its reset) at most 10 us per call.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import psutil

from rankmem._host import LinuxHostProbe

REPEAT = 20000
ROUNDS = 5


def per_call_us(fn: Callable[[], object], n: int = REPEAT) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    if not sys.platform.startswith("linux"):
        raise SystemExit("bench_probe measures the Linux /proc probe")
    probe = LinuxHostProbe(children=True, children_refresh_s=5.0)
    proc = psutil.Process()

    def window_pair() -> None:  # what every window edge of the Monitor does on the host
        probe.rss_and_peak()
        probe.reset_peak()

    cases: dict[str, Callable[[], object]] = {
        "rankmem rss (statm pread)": probe.rss,
        "rankmem current + window peak + reset": window_pair,
        "rankmem full host read (+children, node, cgroup)": probe.read,
        "psutil.Process().memory_info()": proc.memory_info,
        "psutil.virtual_memory()": psutil.virtual_memory,
    }
    best = {name: float("inf") for name in cases}
    for _ in range(ROUNDS):  # interleaved rounds; the best of each is the least disturbed
        for name, fn in cases.items():
            best[name] = min(best[name], per_call_us(fn))
    baseline = best["psutil.Process().memory_info()"]
    print(f"{'case':52s} {'us/call':>9s} {'vs memory_info':>15s}")
    for name, us in best.items():
        print(f"{name:52s} {us:9.2f} {us / baseline:14.2f}x")
    probe.close()
    device_cases()


def device_cases() -> None:
    """On a GPU: one device read (memory_stats + mem_get_info) and a peak reset, against
    ``torch.cuda.memory_allocated()`` (which builds the same stats dict) as the baseline."""
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        print("device: no CUDA GPU here; run scripts/gpu_check.sh on one")
        return
    from rankmem._device import select_backend

    backend = select_backend("cuda")
    assert backend is not None

    def edge() -> None:
        backend.read()
        backend.reset_peaks()

    cases: dict[str, Callable[[], object]] = {
        "torch.cuda.memory_allocated()": torch.cuda.memory_allocated,
        "rankmem device read (stats + mem_get_info)": backend.read,
        "rankmem device edge (read + peak reset)": edge,
    }
    best = {name: min(per_call_us(fn, 2000) for _ in range(ROUNDS)) for name, fn in cases.items()}
    baseline = best["torch.cuda.memory_allocated()"]
    for name, us in best.items():
        print(f"{name:52s} {us:9.2f} {us / baseline:14.2f}x")


if __name__ == "__main__":
    main()
