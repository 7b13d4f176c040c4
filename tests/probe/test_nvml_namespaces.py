"""The host/container PID join on this machine's real /proc: real PID namespaces (``unshare``, as root)
with real child processes; the namespace's own view checked against this process's view of the tree."""

from __future__ import annotations

import glob
import json
import shutil
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "tests" / "dist_scripts" / "nvml_namespace.py"
MIB = 2**20


def _can_unshare() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare(1) here"
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30)
    return None if probe.returncode == 0 else f"unshare --pid needs root here: {probe.stderr.decode().strip()}"


_WHY = _can_unshare()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


def _children(pid: int) -> list[int]:
    return [int(p) for path in glob.glob(f"/proc/{pid}/task/*/children") for p in open(path).read().split()]


def _run(mode: str, *unshare: str) -> tuple[dict[str, Any], int, int]:
    """The script's report, and (seen from here) its host PID and its engine's."""
    proc = subprocess.Popen(["unshare", "--pid", "--fork", *unshare, sys.executable, str(SCRIPT), mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        assert line, "the namespace script printed nothing"
        report = json.loads(line)
        (inner,) = _children(proc.pid)  # unshare --fork: the script is its only child
        engine = [p for p in _children(inner) if p != inner]
        proc.stdin.close()
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0
    return report, inner, engine[0]


def test_host_proc_visible_joins_through_nspid() -> None:
    report, host_pid, engine = _run("host")
    assert report["getpid"] == 1  # the namespace's first process
    assert report["method"].startswith("NSpid") and report["host_pid"] == host_pid != 1
    split = report["split"]
    assert split["descendants_bytes"] == 700 * MIB and split["nontorch_bytes"] == 300 * MIB
    assert split["foreign_bytes"] == 0 and split["reasons"] == {}
    assert engine != report["engine_pid"]  # the engine, too, has another PID out here


def test_container_proc_without_host_pids_says_not_mapped() -> None:
    report, _host_pid, _engine = _run("foreign", "--mount-proc")
    assert report["method"] == "host PIDs not mapped" and report["host_pid"] is None
    split = report["split"]
    for part in ("nontorch", "siblings", "descendants", "foreign"):
        assert split[f"{part}_bytes"] is None and "host PIDs not mapped" in split["reasons"][part]
        assert f"mem/device/{part}_gib/max" not in report["keys"]
    assert split["unattributed_bytes"] == 0  # every byte is in some process, known without the join


def test_translated_pids_join_through_nvml_own_list() -> None:
    report, _host_pid, _engine = _run("translated", "--mount-proc")
    split = report["split"]
    assert split["mapping"].startswith("translated")
    assert split["descendants_bytes"] == 700 * MIB and split["nontorch_bytes"] == 300 * MIB
    assert split["reasons"] == {}
