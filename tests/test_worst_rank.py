"""The worst rank of a low-is-bad key, end to end: a real 3-rank gloo group on faked GPUs where rank 1
shares its device with a colocated 6 GiB engine. Every rank's aggregate, the console line, the run log
and ``rankmem report`` name rank 1 as the one with the least headroom."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from rankmem.cli import main
from tests.conftest import REPO, torchrun

WORLD = 3
HEADROOM = "mem/device/headroom_gib"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("worst")
    proc = torchrun(REPO / "tests/dist_scripts/worst_rank_worker.py", WORLD, [str(out)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout, [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_every_rank_names_rank_1_as_the_least_headroom(job: tuple[Path, str, list[dict[str, Any]]]) -> None:
    _, _, results = job
    for metrics in results:
        assert metrics[f"{HEADROOM}/min_rank"] == 1
        assert metrics[f"{HEADROOM}/max_rank"] == 0  # the safest rank: what max_rank alone used to name
        assert metrics["mem/device/peak_reserved_gib/max_rank"] == 2
        # 16 GiB - (2 GiB + 512 MiB peak reserved + 6 GiB engine + 300 MiB context)
        assert metrics[f"{HEADROOM}/min"] == pytest.approx((16 * 1024 - 2560 - 6144 - 300) / 1024, abs=0.01)
        assert metrics == results[0]


def test_console_line_and_report_name_rank_1(job: tuple[Path, str, list[dict[str, Any]]],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out, stdout, _ = job
    steps = [line for line in stdout.splitlines() if line.startswith("[rankmem] step ")]
    assert len(steps) == 3
    assert all(re.search(r" dev_headroom=7\.\d{3}GiB\(min,r1\)", line) for line in steps), steps
    assert main(["report", str(out)]) == 0
    report = capsys.readouterr().out
    assert re.search(r"^device headroom: min 7\.\d{3} GiB at step 0 on rank 1$", report, re.M), report
    assert main(["report", str(out), "--json"]) == 0
    headroom = json.loads(capsys.readouterr().out)["headroom"]
    assert (headroom["key"], headroom["worst"], headroom["rank"]) == (HEADROOM, "min", 1)


def test_the_run_log_holds_ranks_as_integers(job: tuple[Path, str, list[dict[str, Any]]]) -> None:
    out, _, _ = job
    lines = (out / "rankmem.jsonl").read_text().splitlines()[1:]
    metrics = json.loads(lines[-1])["metrics"]
    assert type(metrics[f"{HEADROOM}/min_rank"]) is int and metrics[f"{HEADROOM}/min_rank"] == 1
    assert type(metrics[f"{HEADROOM}/max_rank"]) is int
    assert f'"{HEADROOM}/min_rank":1,' in lines[-1]
