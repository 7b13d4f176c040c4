"""scripts/gpu_advise_check.py off the GPU: its dry run checks the arguments and imports, and bad
arguments are one clear error (scripts/gpu_check.sh runs it for real on a CUDA device)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts/gpu_advise_check.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_the_dry_run_checks_its_arguments_and_exits() -> None:
    done = _run("--dry-run")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ("gpu_advise_check: dry run: ['sdpa', 'materialized'] probes [2048, 4096, 6144, 8192, "
                           "12288, 16384] x2, checks [24576, 32768], tolerance 0.15\n")
    done = _run("--dry-run", "--attention", "materialized", "--check-tokens", "20000", "--repeats", "3")
    assert done.returncode == 0 and "['materialized']" in done.stdout and "x3, checks [20000]" in done.stdout


def test_bad_arguments_are_one_clear_error() -> None:
    for args, message in [
        (("--probe-tokens", "2k"), "--probe-tokens and --check-tokens take comma-separated integers, e.g. 2048,4096"),
        (("--probe-tokens", "2048,2048"), "--probe-tokens needs at least 3 different sizes >= 1, got 2048,2048"),
        (("--attention", "flash"), "--attention takes sdpa or materialized (comma-separated), got flash"),
        (("--tolerance", "2"), "--tolerance must be between 0 and 1, got 2.0"),
    ]:
        done = _run("--dry-run", *args)
        assert done.returncode == 2, args
        assert done.stderr.splitlines()[-1] == f"gpu_advise_check.py: error: {message}", done.stderr


def test_the_prediction_reads_advise_and_past_its_range_the_fit_itself(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The part of the check that needs no GPU, on a device run log shaped like its probe: ``rankmem
    advise --at-tokens`` inside 1.5x the largest T, the fit directly past it (where advise declines)."""
    import importlib.util

    from tests.offline.test_advice_device import PROBE, caching_run, expected_peak

    spec = importlib.util.spec_from_file_location("gpu_advise_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    out = str(caching_run(tmp_path, PROBE * 2))
    for t, source in ((24576, "advise"), (32768, "its fit")):
        peak, low, high, said = check.predicted(out, t)
        assert said.startswith(source), said
        assert peak == pytest.approx(expected_peak(t), abs=1e-6) and low < peak < high
