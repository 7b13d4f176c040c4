"""Issue 20, "wrong verdicts on ordinary use", with real Monitor runs and real memory: a leak in a loop
that numbers its steps per epoch, a caller metric named like a measured one, a phase nested in a phase
of the same name."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

import rankmem
from tests.conftest import REPO

MIB = 1 << 20
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

EPOCH_LOOP = textwrap.dedent("""
    import sys
    import numpy as np
    import rankmem

    monitor = rankmem.Monitor(out_dir=sys.argv[1], device="cpu", children=False)
    held = []
    for epoch in range(3):
        for i in range(40):  # `for i, batch in enumerate(loader)`: steps 0..39 again each epoch
            with monitor.step(i):
                held.append(np.ones(7 * (1 << 20), dtype=np.uint8))  # 7 MiB a step, touched: 840 MiB in all
            monitor.collect({"loss": 1.0 / (1 + i)})
    monitor.close()
""")


def test_a_leak_in_a_loop_numbered_per_epoch_is_found(tmp_path: Path) -> None:
    out = tmp_path / "run"
    subprocess.run([sys.executable, "-c", EPOCH_LOOP, str(out)], env=ENV, check=True, timeout=300,
                   capture_output=True)
    done = subprocess.run([sys.executable, "-m", "rankmem", "leaks", str(out)], env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("LEAK rank 0 mem/host/rss_gib"))
    # 7 MiB per collect, ground truth; the regression runs on the collect index, and says so.
    slope = float(line.split(": +")[1].split(" MiB/collect")[0])
    assert 6.0 <= slope <= 8.0, line
    assert "over collects" in line and "the step numbers do not rise" in line


def test_a_caller_metric_named_like_a_measured_key_never_replaces_it() -> None:
    monitor = rankmem.Monitor(sinks=(), device="cpu", children=False)
    with pytest.warns(RuntimeWarning, match=r"metric 'mem/host/rss_gib' is in rankmem's namespace 'mem/'.*"
                                            r"logged as 'caller/mem/host/rss_gib'"):
        out = monitor.collect({"mem/host/rss_gib": 123.0, "loss": 2.0})
    with open("/proc/self/statm") as f:
        rss_gib = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    assert out["caller/mem/host/rss_gib/max"] == 123.0 and out["loss/max"] == 2.0
    assert abs(out["mem/host/rss_gib/max"] - rss_gib) < 64 / 1024  # the measured RSS, not the caller's 123
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning, not one per collect
        monitor.collect({"mem/host/rss_gib": 1.0})
    monitor.close()


def test_a_phase_nested_in_a_phase_of_the_same_name_counts_its_growth_once() -> None:
    monitor = rankmem.Monitor(sinks=(), device="cpu", children=False)
    held = []
    with monitor.step(0):
        with monitor.phase("update"):
            held.append(np.ones(96 * MIB, dtype=np.uint8))
            with monitor.phase("update"):  # a helper that opens the phase its caller already opened
                held.append(np.ones(64 * MIB, dtype=np.uint8))
    out = monitor.collect()
    grown_mib = out["mem/phase/update/rss_delta_gib/max"] * 1024
    assert 160 - 16 <= grown_mib <= 160 + 16, grown_mib  # 96 + 64 MiB touched, once (summed twice: 224)
    monitor.close()
