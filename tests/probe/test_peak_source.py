"""peak_source (issue 22, item 4): ``window`` resets VmHWM at every edge, which a parent's ``wait4`` then
reports; ``edges`` never writes clear_refs, so the kernel's high-water mark, and every tool reading it,
stays the process's true peak, while the Monitor keeps its own lifetime peak in both modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import rankmem
from rankmem.errors import RankmemError
from tests.conftest import REPO

MIB = 1 << 20
N_MIB = 512

CHILD = textwrap.dedent(f"""
    import json, os, sys
    import numpy as np
    import rankmem

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    monitor = rankmem.Monitor(device="cpu", sinks=(), children=False, near_oom_watch=False, leak_check=False,
                              peak_source=sys.argv[1])
    before = rss()
    steps = []
    for step in range(4):
        with monitor.step(step):
            if step == 1:
                block = np.ones({N_MIB} * 2**20, dtype=np.uint8)  # allocated and touched: resident
                del block
        steps.append(monitor.collect())
    monitor.close()
    print(json.dumps({{"before": before, "scope": monitor.peak_rss_scope,
                      "lifetime": steps[-1]["mem/host/lifetime_peak_rss_gib/max"] * 2**30,
                      "peaks": [m["mem/host/peak_rss_gib/max"] * 2**30 for m in steps]}}))
""")


# The parent is a bare interpreter: at exec the kernel folds the pre-exec image's high-water mark into the
# child's ru_maxrss, and a fork of pytest (hundreds of MiB) would mask what the child itself reached.
PARENT = textwrap.dedent("""
    import json, os, sys
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.dup2(w, 1)
        os.execv(sys.executable, [sys.executable, "-c", sys.argv[1], sys.argv[2]])
    os.close(w)
    out = b""
    while chunk := os.read(r, 65536):
        out += chunk
    _, status, usage = os.wait4(pid, 0)
    print(json.dumps({"child": out.decode(), "code": os.waitstatus_to_exitcode(status),
                      "maxrss": usage.ru_maxrss * 1024}))  # Linux gives KiB
""")


def _run_child(source: str) -> tuple[dict[str, object], int]:
    """The child's own figures and its ``ru_maxrss`` as its parent's ``wait4`` reports it (bytes)."""
    done = subprocess.run([sys.executable, "-c", PARENT, CHILD, source], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    parent = json.loads(done.stdout)
    assert parent["code"] == 0, done.stderr[-3000:]
    return json.loads(parent["child"]), int(parent["maxrss"])


def test_reset_free_mode_leaves_wait4_the_childs_true_peak() -> None:
    child, maxrss = _run_child("edges")
    true_peak = child["before"] + N_MIB * MIB  # type: ignore[operator]
    assert child["scope"] == "edges"
    assert abs(maxrss - true_peak) < 8 * MIB, (maxrss / MIB, true_peak / MIB)
    assert abs(child["lifetime"] - true_peak) < 8 * MIB  # type: ignore[operator]
    peaks = child["peaks"]
    assert isinstance(peaks, list)
    # Step 1 set a new lifetime high: its window peak is exact even without a reset; the others are floors.
    assert abs(peaks[1] - true_peak) < 8 * MIB and max(peaks[2:]) < true_peak - N_MIB * MIB / 2


def test_window_mode_resets_what_wait4_reports_and_keeps_its_own_lifetime_peak() -> None:
    child, maxrss = _run_child("window")
    true_peak = child["before"] + N_MIB * MIB  # type: ignore[operator]
    assert child["scope"] == "window"
    assert maxrss < true_peak - N_MIB * MIB / 2  # the reset hid the 512 MiB from the parent: why "edges" exists
    assert abs(child["lifetime"] - true_peak) < 8 * MIB  # type: ignore[operator]
    assert abs(child["peaks"][1] - true_peak) < 8 * MIB  # type: ignore[index]


def test_peak_source_is_checked_and_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RankmemError, match=r"peak_source must be one of \['window', 'edges'\] "
                                           r"\(docs/peak-source.md\), got 'reset'"):
        rankmem.MonitorConfig(peak_source="reset")
    monkeypatch.setenv("RANKMEM_PEAK_SOURCE", "edges")
    assert rankmem.MonitorConfig().peak_source == "edges"
    monitor = rankmem.Monitor(device="cpu", near_oom_watch=False)
    assert monitor.peak_rss_scope == "edges" and monitor.config.to_header()["peak_source"] == "edges"
    monitor.close()


def test_the_report_flags_a_run_whose_window_peaks_were_sampled(tmp_path: object,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from rankmem.cli import main

    out = str(tmp_path)
    monitor = rankmem.Monitor(out_dir=out, device="cpu", near_oom_watch=False, peak_source="edges")
    for step in range(3):
        with monitor.step(step):
            pass
        monitor.collect()
    monitor.close()
    assert main(["report", out]) == 0
    text = capsys.readouterr().out
    assert "peak RSS per window: sampled at window edges (peak_source='edges', VmHWM never reset)" in text
    assert main(["report", out, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_rss_scope"] == "edges"
