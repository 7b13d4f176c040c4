"""Run inside a PID namespace by tests/probe/test_nvml_namespaces.py: a Monitor over FakeCuda + FakeNvml,
with a real child process as the engine, reports how it joined NVML's PIDs and its split, as one JSON
line; then waits for stdin to close (so that the test can look at this process tree from outside).

    unshare --pid --fork [--mount-proc] python tests/dist_scripts/nvml_namespace.py MODE

MODE: ``host`` (the driver reports host PIDs, here the PIDs of /proc's namespace), ``foreign`` (the
driver reports a host PID this namespace cannot see), ``translated`` (the driver reports ours).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

from rankmem import Monitor
from rankmem.probe.pidmap import pid_view
from rankmem.testing import FakeCuda, FakeNvml

MIB = 2**20
mode = sys.argv[1]
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
# The PIDs /proc lists for this process's children: what a driver in /proc's namespace would report.
listed = [int(p) for path in glob.glob("/proc/self/task/*/children") for p in open(path).read().split()]
cuda = FakeCuda(context=300 * MIB)
own = {"host": None, "foreign": 4_000_000 + os.getpid(), "translated": os.getpid()}[mode]
nvml = FakeNvml(cuda, own_pid=own)
nvml.add_process(engine.pid if mode != "host" else listed[0], 700 * MIB)
monitor = Monitor(device_module=cuda, nvml_module=nvml, sinks=(), nvml_refresh_s=0.02, leak_check=False)
cuda.set_device(0)
cuda.malloc(1000 * MIB)
out: dict[str, float] = {}
for step in range(300):
    with monitor.step(step):
        time.sleep(0.02)
    out = monitor.collect()
    if "mem/device/unattributed_gib/max" in out:
        break
split = monitor._attribution.fresh(2.0) if monitor._attribution is not None else None
view = pid_view()
print(json.dumps({"getpid": os.getpid(), "engine_pid": engine.pid, "method": view.method, "host_pid": view.host_pid,
                  "split": split.to_event() if split is not None else None,
                  "keys": {k: v for k, v in out.items() if k.startswith("mem/device/") and k.endswith("/max")}}),
      flush=True)
sys.stdin.read()
monitor.close()
engine.kill()
