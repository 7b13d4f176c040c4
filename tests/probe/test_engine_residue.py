"""The engine's residue after sleep as a series: two ranks (torchrun, gloo) on FakeCuda + FakeNvml, each with
a real child process standing in for its colocated engine; rank 1's engine holds 8 MiB more after each
sleep, rank 0's the same 400 MiB. The series is what each engine held at the end of each sleep, and the
leak verdicts flag rank 1's growth, not rank 0's steady residue."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rankmem.offline import read_run
from rankmem.probe.pidmap import pid_namespace_inode
from tests.conftest import REPO, torchrun

KEY = "mem/device/engine_residue_gib"

pytestmark = pytest.mark.skipif(pid_namespace_inode() != 0xEFFFFFFC,
                                reason="the engine is found among this rank's descendants by its host PID")


def _cli(*argv: str) -> str:
    done = subprocess.run([sys.executable, "-m", "rankmem", *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    return done.stdout


def test_the_residue_after_each_sleep_is_a_series_and_its_growth_names_the_rank(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = torchrun(REPO / "tests/dist_scripts/engine_residue_worker.py", 2, [str(out)], timeout=180,
                    env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = read_run(str(out))
    series = run.series[KEY] * 1024
    for rank in range(2):
        held = {int(k): v for k, v in json.loads((out / f"held{rank}.json").read_text()).items()}
        # From the second step: the first sleep ends before the device split has started (it starts
        # with the first collect, once the device has a context).
        expected = np.array([held[int(s)] for s in run.steps])
        assert np.array_equal(series[1:, rank], expected[1:]), (rank, series[:, rank])
    leaks = json.loads(_cli("leaks", str(out), "--json"))["leaks"]
    assert [(t["key"], t["rank"]) for t in leaks] == [(KEY, 1)]
    assert leaks[0]["slope_mib"] == pytest.approx(8.0)
    report = _cli("report", str(out))
    assert f"LEAK rank 1 {KEY}: +8.000 MiB/step" in report
    assert any(line.startswith(KEY) for line in report.splitlines())  # in the key table
