"""The habits of the ``rankmem`` command, with exact output: a subcommand's own usage on its error,
did-you-mean for commands and flags, output paths checked before any work, nothing left behind by a
refused launch, warnings as one line, the newest run as the default RUN, a parent's runs listed,
``--json`` on the read commands, and the bash completion script driven in a real bash."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rankmem.cli import main
from rankmem.cli._showwarning import format_warning
from tests.conftest import REPO
from tests.runlog_helpers import known_run

REPORT_USAGE = """usage: rankmem report [-h] [--json] [--html FILE] [--window FRAC] [--last N]
                      [--min-steps N] [--noise-factor K]
                      [--capacity-fraction F] [--min-growth MIB]
                      [--alpha ALPHA] [--imbalance-floor-mib FLOOR]
                      [--imbalance-fraction FRACTION]
                      [RUN]
"""


@pytest.fixture(autouse=True)
def _columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps its usage to the terminal


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse's errors
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_mistyped_flag_shows_the_subcommands_usage_and_the_nearest_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(capsys, "report", "--josn", "x") == (
        2, "", REPORT_USAGE + "rankmem report: error: unrecognized arguments: --josn (did you mean --json?)\n")
    rc, _, err = _cli(capsys, "watch", "--once", "--intreval=2", "x")
    assert rc == 2 and err.startswith("usage: rankmem watch ")
    assert err.endswith("rankmem watch: error: unrecognized arguments: --intreval=2 (did you mean --interval?)\n")
    rc, _, err = _cli(capsys, "report", "--zzzz", "x")
    assert err.endswith("rankmem report: error: unrecognized arguments: --zzzz\n")


def test_a_mistyped_command_gets_the_nearest(capsys: pytest.CaptureFixture[str]) -> None:
    usage = "usage: rankmem [-h] [--version] COMMAND ...\n"
    assert _cli(capsys, "reprot", "runs/x") == (2, "",
                                                usage + "rankmem: error: no command 'reprot'; did you mean 'report'?\n")
    rc, _, err = _cli(capsys, "xyzzy")
    assert err == usage + ("rankmem: error: no command 'xyzzy'; the commands are: train, report, plot, advise, leaks, "
                           "export, watch, doctor, completion\n")


def test_output_paths_are_checked_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    known_run(tmp_path)
    bad = tmp_path / "BAD" / "page.html"
    assert _cli(capsys, "report", str(tmp_path), "--html", str(bad)) == (
        2, "", f"rankmem report: error: --html {bad}: no such directory: {tmp_path / 'BAD'}\n")
    assert _cli(capsys, "plot", str(tmp_path), "-o", str(tmp_path)) == (
        2, "", f"rankmem plot: error: -o {tmp_path}: is a directory; name a file in it\n")
    assert not (tmp_path / "rankmem.png").exists()


def test_a_refused_ray_launch_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as without the extra
    out = tmp_path / "out"
    assert _cli(capsys, "train", "--launcher", "ray", "--out", str(out)) == (
        2, "", "rankmem train: error: rankmem train --launcher ray needs ray, which is not installed: "
               "pip install 'rankmem[ray]'\n")
    assert not out.exists()


def test_warnings_print_as_one_line_with_relative_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    here = str(tmp_path / "train.py")
    assert format_warning(f"rankmem: {tmp_path}/runs/x/rankmem.jsonl was\nrotated", RuntimeWarning, "rankmem", 0) == \
        "rankmem: runs/x/rankmem.jsonl was rotated\n"
    assert format_warning("deprecated", FutureWarning, here, 12) == "rankmem: FutureWarning: deprecated (train.py:12)\n"
    lib = str(REPO / "rankmem" / "offline" / "plot.py")
    assert format_warning("odd", UserWarning, lib, 3) == "rankmem: UserWarning: odd (rankmem/offline/plot.py:3)\n"
    # In a process of its own: pytest records warnings, and a recorder keeps what it records.
    code = ("import os; from rankmem.cli._showwarning import one_line_warnings; from rankmem.core.warnings import "
            "warn\n"
            "with one_line_warnings():\n    warn('rankmem: cannot write ' + os.getcwd() + '/runs/a/x')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (done.returncode, done.stderr) == (0, "rankmem: cannot write runs/a/x\n")


def _runs(tmp_path: Path) -> None:
    for name, age in (("runs/old", 100), ("runs/new", 10), ("runs/sweep/lr1", 50)):
        known_run(tmp_path / name)
        t = time.time() - age
        os.utime(tmp_path / name / "rankmem.jsonl", (t, t))


def test_the_read_commands_default_to_the_newest_run_and_say_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    _runs(tmp_path)
    rc, out, err = _cli(capsys, "leaks")
    assert (rc, err) == (0, "rankmem leaks: no RUN given: reading runs/new, the newest run under runs/\n")
    assert out == "no leak found (4 rank series checked)\n"
    rc, out, err = _cli(capsys, "report", "--json")
    assert json.loads(out)["path"] == "runs/new/rankmem.jsonl"


def test_a_parent_directory_lists_its_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    _runs(tmp_path)

    def when(name: str) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(os.stat(tmp_path / name / "rankmem.jsonl").st_mtime))

    listing = ("rankmem plot: error: runs holds no run log; it holds 3 runs, newest first: pass one of them\n"
               f"  runs/new        {when('runs/new')}\n  runs/sweep/lr1  {when('runs/sweep/lr1')}\n"
               f"  runs/old        {when('runs/old')}\n")
    assert _cli(capsys, "plot", "runs") == (2, "", listing)
    shutil.rmtree(tmp_path / "runs")
    assert _cli(capsys, "report") == (2, "", "rankmem report: error: no RUN given and no run under runs/ here: pass "
                                             "a run directory (the --out of rankmem train, runs/train by default) or "
                                             "its rankmem.jsonl\n")


def test_plot_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    known_run(tmp_path)
    rc, out, _ = _cli(capsys, "plot", str(tmp_path), "--json", "-o", str(tmp_path / "p.png"))
    assert rc == 0 and json.loads(out) == {"output": str(tmp_path / "p.png"),
                                           "keys": ["mem/host/rss_gib", "mem/host/peak_rss_gib"]}
    assert (tmp_path / "p.png").stat().st_size > 1000


def _complete(words: list[str]) -> list[str]:
    script = subprocess.run([sys.executable, "-m", "rankmem", "completion", "bash"], cwd=REPO, capture_output=True,
                            text=True, timeout=60, check=True).stdout
    line = " ".join(f"'{w}'" for w in words)
    probe = f'{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; _rankmem; printf "%s\\n" "${{COMPREPLY[@]}}"'
    done = subprocess.run(["bash", "--norc", "--noprofile", "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return sorted(x for x in done.stdout.splitlines() if x)


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")
def test_bash_completion_offers_commands_flags_and_choices() -> None:
    assert _complete(["rankmem", "rep"]) == ["report"]
    assert _complete(["rankmem", "d"]) == ["doctor"]
    assert _complete(["rankmem", "report", "--ht"]) == ["--html"]
    assert _complete(["rankmem", "watch", "runs/x", "--w"]) == ["--wait"]
    assert _complete(["rankmem", "train", "--launcher", ""]) == ["ray", "torchrun"]
    assert _complete(["rankmem", "completion", ""]) == ["bash"]
    assert _complete(["rankmem", "report", "ru"]) == []  # a RUN: bash's file names (complete -o default)
