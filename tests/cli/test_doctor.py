"""``rankmem doctor``: exit 0 and the exact key lines for this machine, computed independently."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

import rankmem
from rankmem.cli import main
from rankmem.cli._doctor import EXTRAS, SCOPES


def test_doctor_reports_versions_backend_scope_cgroup_out_dir_and_extras(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    assert main(["doctor", "--out", str(tmp_path / "new")]) == 0
    lines = capsys.readouterr().out.splitlines()
    package = os.path.dirname(os.path.abspath(rankmem.__file__))
    assert lines[0] == f"rankmem: {rankmem.__version__} at {package} (python {sys.version.split()[0]})"
    assert lines[1] == (f"torch: {torch.__version__} (CUDA {torch.version.cuda} build)" if torch.version.cuda
                        else f"torch: {torch.__version__} (no CUDA in this build)")
    if not torch.cuda.is_available():
        assert lines[2] == ("device backend: none: torch sees no cuda, npu or xpu device; rankmem reports host "
                            "memory only")
    try:  # the host peak resets per window where this process may write clear_refs
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        scope = "window (VmHWM reset at each window edge through /proc/self/clear_refs)"
    except OSError:
        scope = "lifetime (this kernel cannot reset VmHWM: peak RSS is the process's lifetime peak)"
    assert f"host peak RSS scope: {scope}" in lines
    assert any(line.startswith("host now: this process's RSS 0.") for line in lines)
    assert sum(line.startswith("cgroup: ") for line in lines) == 1
    assert f"run directory {tmp_path / 'new'}: writable (to be created under {tmp_path}): " \
           "rankmem.jsonl, heartbeat/ and events/" in lines
    extras = lines[lines.index("extras:") + 1:]
    assert [line.split()[0] for line in extras] == [e for e, _, _ in EXTRAS]
    for line, (extra, modules, _) in zip(extras, EXTRAS, strict=True):
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        assert line.split()[1] == ("missing" if missing else "ok"), line
        if missing and extra != "verl":
            assert f"pip install 'rankmem[{extra}]'" in line
        if extra == "verl":  # its pins would downgrade transformers: never suggested
            assert "pip install" not in line and "rankmem[verl]" not in line


def test_doctor_names_a_run_directory_it_cannot_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    assert main(["doctor", "--out", str(tmp_path / "file" / "run")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("run directory"))
    assert line == (f"run directory {tmp_path}/file/run: NOT writable (not a directory: {tmp_path}/file): "
                    "choose another --out")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert main(["doctor", "--out", str(locked)]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("run directory"))
        assert line == f"run directory {locked}: NOT writable (Permission denied: {locked}): choose another --out"


def test_doctor_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(["doctor", "--out", str(tmp_path)]) == 0
    assert ("  wandb        missing wandb: pip install 'rankmem[wandb]' for the wandb sink"
            in capsys.readouterr().out.splitlines())


def test_doctor_says_what_the_peak_source_does_to_other_tools(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    source = next(line for line in lines if line.startswith("peak source: "))
    if any(line.startswith("host peak RSS scope: window") for line in lines):
        assert "getrusage, a parent's wait4, /usr/bin/time -v and VmHWM pollers" in source
        assert "RANKMEM_PEAK_SOURCE=edges" in source
    monkeypatch.setenv("RANKMEM_PEAK_SOURCE", "edges")  # what a job's environment chooses, doctor reports
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("host peak RSS scope: edges (peak_source='edges': VmHWM never reset") for line in lines)
    assert "peak source: edges: VmHWM is left alone, so getrusage, wait4, time -v and VmHWM pollers stay true" in lines


def test_doctor_hints_only_what_helps(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                      tmp_path: Path) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("torch", "verl") else real(name,
                                                                                                                  *a))
    assert main(["doctor", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("torch: not installed: install the build for your accelerator as "
                        "https://pytorch.org/get-started/locally/ says (until then rankmem reads host memory only)")
    assert ("  verl         not installed: nothing to install here; a verl job: rankmem.integrations.verl needs "
            "nothing more than verl itself") in lines
    assert not any("rankmem[torch]" in line or "rankmem[verl]" in line for line in lines)


def test_doctor_json_is_one_object_with_the_same_findings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert main(["doctor", "--json", "--out", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["rankmem"] == rankmem.__version__ and doc["python"] == sys.version.split()[0]
    assert doc["lines"][0] == lines[0] and doc["lines"][-len(EXTRAS):] == lines[-len(EXTRAS):]
    assert doc["run_dir"] == {"path": str(tmp_path), "writable": True,
                              "line": f"run directory {tmp_path}: writable: rankmem.jsonl, heartbeat/ and events/"}
    assert f"host peak RSS scope: {SCOPES[doc['peak_rss_scope']]}" in lines
    assert list(doc["extras"]) == [e for e, _, _ in EXTRAS]
    for extra, modules, _ in EXTRAS:
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        assert doc["extras"][extra]["missing"] == missing
