"""A torchrun ``--max-restarts`` restart into the same out_dir (issue 20): the clean attempt's report must
not open with the failed attempt's OOM event. Every file of the failed attempt moves aside with one
number, and readers check the run id whatever is left beside the new run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rankmem.offline import read_run
from tests.conftest import REPO, torchrun

SCRIPT = REPO / "tests" / "dist_scripts" / "restart_worker.py"


def _report(path: Path) -> dict:  # type: ignore[type-arg]
    done = subprocess.run([sys.executable, "-m", "rankmem", "report", "--json", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


@pytest.mark.slow  # rotation and run ids, in-process: test_engine, test_reader_faults
def test_the_clean_attempt_after_a_restart_reports_no_event_of_the_failed_one(tmp_path: Path) -> None:
    # torchrun shares its rendezvous TCPStore with the ranks, and a restarted attempt reads the failed
    # attempt's keys still in it: gloo then dials the dead ranks' ports (refused, or hung in connect).
    # Under load that failed 11 of 12 launches here and 0 of 12 with the store not shared (pytorch#135712).
    out = tmp_path / "run"
    done = torchrun(SCRIPT, 2, [str(out)], extra=["--max-restarts", "1"], timeout=240,
                    env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    tmp_path = out
    assert read_run(str(tmp_path)).steps.tolist() == [0, 1, 2, 3]  # the second attempt's 4 steps
    assert _report(tmp_path)["events"] == []  # before: it opened with the first attempt's OOM
    # The failed attempt, whole under one number: its log, side file, events and heartbeats.
    first = tmp_path / "rankmem.jsonl.1"
    run_id = json.loads(first.read_text().splitlines()[0])["run_id"]
    assert read_run(str(first)).steps.tolist() == [0, 1, 2]
    (event,) = [json.loads(line) for line in (tmp_path / "events.1" / "rank1.jsonl").read_text().splitlines()]
    assert event["kind"] == "oom" and event["run_id"] == run_id
    assert sorted(p.name for p in (tmp_path / "heartbeat.1").iterdir()) == ["rank0.hb", "rank1.hb"]
    assert [e["kind"] for e in _report(first)["events"]] == ["oom"]  # the rotated log reads its own events
    # A foreign event left beside the new run (a rotation that could not happen) is counted, not shown.
    (tmp_path / "events" / "rank1.jsonl").write_text((tmp_path / "events.1" / "rank1.jsonl").read_text())
    report = _report(tmp_path)
    assert report["events"] == [] and report["foreign_events"] == 1
