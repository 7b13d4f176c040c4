"""``rankmem report``: the worst value of each key with its step, rank and phase; JSON; the verdict lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rankmem.cli import main
from rankmem.runlog import RUN_LOG_NAME
from tests.runlog_helpers import known_run


def test_report_names_the_rank_step_and_phase(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = known_run(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [f"run log: {path}", "4 ranks on 1 host, 40 logged steps (steps 0..39)"]
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.strip().startswith("mem/")}
    assert rows["mem/host/peak_rss_gib"][:6] == ["max", "4.500", "GiB", "7", "2", "update"]
    assert rows["mem/device/headroom_gib"] == ["min", "0.250", "GiB", "3", "1"]
    worst, value, unit, _, rank, imbalance = rows["mem/host/rss_gib"]  # no phase: RSS is a current value
    assert (worst, unit, rank) == ("max", "GiB", "2") and 3.0 < float(value) < 3.02
    assert float(imbalance) == pytest.approx(3.0 / 1.5, abs=0.02)  # max / mean of the per-rank peaks
    assert "device headroom: min 0.250 GiB at step 3 on rank 1" in lines
    assert lines[-1] == "leaks: none found (4 rank series checked)"  # RSS only: no device, no workers


def test_report_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    known_run(tmp_path)
    assert main(["report", str(tmp_path / RUN_LOG_NAME), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = {k["key"]: k for k in out["keys"]}
    peak = keys["mem/host/peak_rss_gib"]
    assert (peak["value"], peak["step"], peak["rank"], peak["phase"]) == (4.5, 7, 2, "update")
    rollout_peaks = [keys["mem/host/peak_rss_gib"]["imbalance"]]
    assert rollout_peaks[0] == pytest.approx(4.5 / ((1.5 * 3 + 4.5) / 4), rel=0.01)  # max / mean of per-rank peaks
    assert keys["mem/device/headroom_gib"]["imbalance"] is None
    assert out["headroom"]["rank"] == 1 and out["leaks"] == [] and out["world_size"] == 4
    assert out["corrupt"] == 0 and out["truncated"] is False
