"""The online watches' first judgements add nothing to the rank's memory in the middle of a run.

A process's first fit leaves ~2 MiB resident for good (numpy's code pages and workspaces). The advice
watch first judges at the 10th collect and the leak watch at the 100th, in the logging rank's own
process, whose between-step RSS the host advice fits: unprimed, its baseline stepped up there, noise
in every window after it. The publisher primes on every rank when it is made
(:func:`rankmem.fit.pooled.prime`). In a fresh process (the cost is once per process, and this test's own
process has fitted long before), a monitor's RSS from collect 5 to 125 of empty steps, each with a
phase told one micro-batch: measured unprimed +2.71 MiB (2.24 of it at collect 10), primed +0.37 MiB.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

MIB = 1 << 20

SCRIPT = """
import numpy as np
import rankmem

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

monitor = rankmem.Monitor(sinks=(), device="cpu", near_oom_watch=False, children=False)
rng = np.random.default_rng(0)
seen = []
for step in range(126):
    with monitor.step(step), monitor.phase("update"):
        monitor.micro_batch(tokens=float(rng.integers(1000, 3000)))
    monitor.collect({"loss": 1.0})
    seen.append(rss())
monitor.close()
print(seen[125] - seen[5])
"""


def test_the_watches_first_judgements_do_not_step_the_ranks_memory_up() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    grew = int(proc.stdout)
    assert grew < MIB, f"RSS grew {grew / MIB:.2f} MiB from collect 5 to 125, over both watches' first judgements"
