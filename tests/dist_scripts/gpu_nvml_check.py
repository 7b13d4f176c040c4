"""The device-attribution check on a real GPU (scripts/gpu_check.sh runs it): real torch.cuda, real NVML.

    python tests/dist_scripts/gpu_nvml_check.py [N_GIB]

A child process holds N GiB (default 2) on this process's device; the Monitor's split must find it as
a descendant within 64 MiB of what it added to device used (mem_get_info before and after it started,
this process idle meanwhile), and the parts must sum to device used within 1% + 64 MiB. Prints the p50
and p99 wall time of NVML's process enumeration. Exit 0 when both hold, 1 otherwise, 2 without NVML.
"""

from __future__ import annotations

import subprocess
import sys
import time

import torch

from rankmem import Monitor
from rankmem.probe import nvml as _nvml

MIB = 2**20
CHILD = """
import sys, time, torch
x = torch.ones(int(float(sys.argv[1]) * 2**30) // 4, dtype=torch.float32, device="cuda:0")
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.read()
"""


def main(n_gib: float) -> int:
    torch.cuda.set_device(0)
    held = torch.ones(256 * MIB // 4, device="cuda:0")  # this rank's own torch memory
    torch.cuda.synchronize()
    monitor = Monitor(sinks=(), nvml_refresh_s=0.2, leak_check=False, near_oom_watch=False)
    free0, _total = torch.cuda.mem_get_info(0)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(n_gib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "ready":
            print("FAIL: the child could not allocate its memory")
            return 1
        free1, _ = torch.cuda.mem_get_info(0)
        added = free0 - free1  # what the child holds: its tensor, its context, its allocator's rounding
        split = None
        for step in range(100):
            with monitor.step(step):
                time.sleep(0.05)
            monitor.collect()
            attribution = monitor._attribution
            split = attribution.fresh(2.0) if attribution is not None else None
            if split is not None and split.processes is not None:
                break
        print("attribution:", monitor.device_attribution)
        if split is None or split.descendants is None:
            print(f"FAIL: no descendants figure: {split.reasons if split else 'no split'}")
            return 2 if split is None else 1
        parts = [split.reserved, split.nontorch, split.siblings, split.descendants, split.foreign, split.unattributed]
        print("split (MiB):", {k: (None if v is None else round(v / MIB)) for k, v in split.to_event().items()
                               if k.endswith("_bytes")}, "reasons:", split.reasons)
        ok = True
        off = abs(split.descendants - added)
        print(f"child added {added / MIB:.0f} MiB; descendants {split.descendants / MIB:.0f} MiB (off {off / MIB:.1f} "
              "MiB)")
        ok &= off <= 64 * MIB
        if None in parts or split.used is None:
            print("FAIL: a part is unknown:", split.reasons)
            ok = False
        else:
            total = sum(p for p in parts if p is not None)
            gap = abs(total - split.used)
            print(f"parts sum {total / MIB:.0f} MiB; device used {split.used / MIB:.0f} MiB (off {gap / MIB:.1f} MiB)")
            ok &= gap <= 0.01 * split.used + 64 * MIB
        timing(monitor)
        del held
        return 0 if ok else 1
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(30)
        monitor.close()


def timing(monitor: Monitor, n: int = 200) -> None:
    nvml, why = _nvml.load()
    if nvml is None:
        print("no timing:", why)
        return
    device, why = _nvml.NvmlDevice.open(nvml, _nvml.uuid_candidates(torch.cuda, 0))
    if device is None:
        print("no timing:", why)
        return
    costs = []
    for _ in range(n):
        start = time.perf_counter()
        device.processes()
        costs.append(time.perf_counter() - start)
    costs.sort()
    print(f"process enumeration (compute + graphics lists), {n} calls: p50 {costs[n // 2] * 1e3:.3f} ms, "
          f"p99 {costs[int(n * 0.99)] * 1e3:.3f} ms")


if __name__ == "__main__":
    sys.exit(main(float(sys.argv[1]) if len(sys.argv) > 1 else 2.0))
