"""What starting rankmem loads, in a fresh process: the Monitor's modules only, and no command line or
offline layer; the command's help none of the heavy ones (numpy, the offline layer, the Monitor's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rankmem.cli import COMMANDS
from tests.conftest import REPO

HEAVY = ("numpy", "torch", "rankmem.offline", "rankmem.fit.", "rankmem.trend.trend")
"""Loaded by none of these (``rankmem.fit.`` its modules: the package itself holds one constant)."""


def loaded(code: str) -> set[str]:
    """The modules a fresh interpreter holds after ``code`` that it did not hold before."""
    script = (f"import sys; before = set(sys.modules)\n{code}\n"
              "import json\nprint(json.dumps(sorted(set(sys.modules) - before)))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout.splitlines()[-1]))


def heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h if h.endswith(".") else h + ".") for h in HEAVY))


def test_import_rankmem_loads_its_version_alone() -> None:
    assert {m for m in loaded("import rankmem") if m.startswith("rankmem")} == {
        "rankmem", "rankmem.core", "rankmem.core.version"}


def test_the_monitor_loads_no_numpy_cli_or_offline_layer() -> None:
    got = loaded("from rankmem import Monitor, MonitorConfig, sample, allgather_dict_into_dict")
    assert "rankmem.monitor" in got
    assert heavy(got) == []
    assert not any(m.startswith("rankmem.cli") for m in got)
    assert "rankmem.exchange.exchange" not in got  # numpy's: built at the first collect
    # track()'s, a device's, CUDA's, a torchrun id's and an OOM snapshot's: loaded where used
    assert not got & {"rankmem.anatomy", "rankmem.forensics.sampler", "rankmem.probe.nvmlwatch", "concurrent.futures",
                      "hashlib", "secrets", "tempfile", "pickle"}


def test_tracking_a_model_loads_the_anatomy() -> None:
    got = loaded("import rankmem, torch\nm = rankmem.Monitor(device='cpu', leak_check=False, near_oom_watch=False)\n"
                 "m.track(torch.nn.Linear(2, 2))\nassert m.tracker is not None\nm.close()")
    assert "rankmem.anatomy" in got


def test_building_a_monitor_leaves_the_first_fit_to_its_own_thread() -> None:
    """Monitor() starts the priming on a thread; by the first collect the fit has run (numpy loaded)."""
    code = """
import tempfile, threading
import rankmem
m = rankmem.Monitor(out_dir=tempfile.mkdtemp(), device="cpu", near_oom_watch=False)
names = [t.name for t in threading.enumerate()]
assert "rankmem-prime" in names, names
m.collect({"loss": 1.0})
m.close()
"""
    got = loaded(code)
    assert {"numpy", "rankmem.fit", "rankmem.exchange.exchange"} <= got


@pytest.mark.parametrize("command", [[], *([name] for name in COMMANDS)])
def test_help_loads_nothing_heavy(command: list[str]) -> None:
    """Every command's help, the readers' too: their option defaults come from numpy-free modules."""
    argv = [*command, "--help"]
    got = loaded(f"from rankmem.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass")
    assert heavy(got) == []
    assert "rankmem.monitor" not in got
