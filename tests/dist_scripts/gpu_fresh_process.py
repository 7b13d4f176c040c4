"""A Monitor in a process that has not touched CUDA creates no context, and reads nothing until then.

    python tests/dist_scripts/gpu_fresh_process.py

Run in a fresh process by tests/test_gpu.py and scripts/gpu_check.sh (a pytest process may have
initialised CUDA already). The witness is the driver: ``torch._C._cuda_hasPrimaryContext`` asks it
whether a device has a primary context without creating one. On a machine without a CUDA GPU only
the part before the first CUDA call runs. Prints one line per check; exits non-zero on a failure.
"""

from __future__ import annotations

import torch

import rankmem
from rankmem.core.units import GIB, MIB
from rankmem.probe.device import select_backend


def contexts() -> list[int]:
    has = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has is None:  # a CPU build: nothing can hold a context
        return []
    return [i for i in range(torch.cuda.device_count()) if has(i)]  # device_count() initialises nothing


def main() -> None:
    monitor = rankmem.Monitor(sinks=(), children=False)
    with monitor.step(0):
        pass
    before = monitor.collect()
    reading = select_backend("cuda").read()  # type: ignore[union-attr]
    assert not torch.cuda.is_initialized(), "building a Monitor and collecting initialised CUDA"
    assert contexts() == [], f"a CUDA context exists on {contexts()} before the first CUDA call"
    assert not any(k.startswith("mem/device/") for k in before), sorted(before)
    figures = [f for f in reading.__dataclass_fields__ if f != "before_init"]
    assert reading.before_init and all(getattr(reading, f) is None for f in figures), reading
    print("fresh process: Monitor() + collect() created no context; a read before init is all None")
    if not torch.cuda.is_available():
        print("fresh process: no CUDA GPU, the part after the first CUDA call is skipped")
        return

    torch.cuda.set_device(0)  # the training script's own first CUDA call
    with monitor.step(1):
        spike = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
        del spike
    after = monitor.collect()
    peak = after["mem/device/peak_allocated_gib/max"] * GIB
    assert peak >= 256 * MIB, f"step 1 peaked at {peak / MIB:.1f} MiB, expected >= 256 MiB"
    assert contexts() == [0], f"contexts on {contexts()}, expected only cuda:0"
    print(f"fresh process: after set_device(0) the window peak is {peak / MIB:.1f} MiB; contexts only on cuda:0")


if __name__ == "__main__":
    main()
