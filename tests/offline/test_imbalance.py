"""Imbalance explained, on 4 real gloo ranks whose phases allocate 64 KiB per token: a rank with twice
the tokens is explained by them, a hidden 200 MiB buffer is not (noted under the default floor, flagged
under a lower one), 20 balanced runs flag and note no rank. One torchrun launch makes every run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rankmem.cli import main
from rankmem.offline import read_run
from rankmem.offline.imbalance import rank_excess
from tests.conftest import REPO, torchrun
from tests.dist_scripts.imbalance_worker import BUFFER_RANK, TOKENS_RANK

WORKER = REPO / "tests/dist_scripts/imbalance_worker.py"
MIB = 1 / 1024
# The default floor, 256 MiB, is over the 200 MiB buffer: the split is checked at half of it, where the
# buffer is flagged and a balanced run still is not.
LOW_FLOOR = 0.125
BALANCED = list(range(10, 30))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("imbalance")
    specs = ["tokens=3", "buffer=4", "balanced=" + ",".join(map(str, BALANCED))]
    proc = torchrun(WORKER, 4, [str(out), *specs], timeout=480)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _imbalance_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(("imbalance", "IMBALANCE", "note"))]


def test_twice_the_tokens_is_explained_by_the_tokens(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = read_run(str(runs / "tokens/3"))
    split = {e.rank: e for e in rank_excess(run, floor_gib=LOW_FLOOR)}
    k = split[TOKENS_RANK]
    assert k.excess > 40 * MIB  # ~1000 tokens more than the others' mean, at 64 KiB each
    assert k.explained >= 0.9 * k.excess and abs(k.unexplained) <= 0.1 * k.excess
    assert not any(e.flagged or e.noted for e in split.values())
    assert main(["report", str(runs / "tokens/3")]) == 0
    lines = _imbalance_lines(capsys.readouterr().out)
    assert len(lines) == 1 and lines[0].startswith(f"imbalance update rank {TOKENS_RANK}: peak +")


def test_a_hidden_buffer_is_flagged_unexplained(runs: Path) -> None:
    run = read_run(str(runs / "buffer/4"))
    split = {e.rank: e for e in rank_excess(run, floor_gib=LOW_FLOOR)}
    j = split[BUFFER_RANK]
    assert abs(j.unexplained - 200 * MIB) <= 0.1 * 200 * MIB + 16 * MIB, j
    assert j.flagged and [e.rank for e in split.values() if e.flagged] == [BUFFER_RANK]
    default = {e.rank: e for e in rank_excess(run)}
    assert not any(e.flagged for e in default.values())  # 200 MiB is under the default floor of 256 MiB
    assert [e.rank for e in default.values() if e.noted] == [BUFFER_RANK]  # but it stands clear of the noise
    assert default[BUFFER_RANK].noise < 25 * MIB and default[BUFFER_RANK].threshold == 0.25


def test_report_notes_the_buffer_under_the_default_floor_and_flags_it_under_a_lower_one(
        runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(runs / "buffer/4")
    assert main(["report", path]) == 0
    [note] = _imbalance_lines(capsys.readouterr().out)
    got = re.fullmatch(rf"note update rank {BUFFER_RANK}: \+(\d+) MiB unexplained, clear of the noise \(\d+ MiB a "
                       r"step\) but under the flag threshold of 256 MiB \(peak \+\d+ MiB over the other ranks, "
                       r"[+-]\d+ MiB from its tokens; --imbalance-floor-mib lowers the threshold\)", note)
    assert got is not None, note
    assert abs(int(got.group(1)) - 200) <= 36, note

    assert main(["report", path, "--imbalance-floor-mib", "128"]) == 0
    [flag] = _imbalance_lines(capsys.readouterr().out)
    assert flag.startswith(f"IMBALANCE update rank {BUFFER_RANK}: peak +") and flag.endswith(
        "MiB unexplained (not its tokens: an engine, a driver duty, a leak?)"), flag

    assert main(["report", path, "--imbalance-fraction", "0.9"]) == 0  # max(90% of the mean rise, 256 MiB)
    assert _imbalance_lines(capsys.readouterr().out)[0].startswith(f"note update rank {BUFFER_RANK}: +")


def test_report_help_shows_the_flag_rule_and_bad_values_are_one_clear_error(
        runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "over max(FRACTION x the phase's mean peak rise, FLOOR)" in text
    assert "--imbalance-floor-mib FLOOR the least unexplained excess flagged, MiB (default 256)" in text
    assert "--imbalance-fraction FRACTION the share of the mean peak rise flagged (default 0.1)" in text
    assert main(["report", str(runs / "buffer/4"), "--imbalance-floor-mib", "-1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "rankmem report: error: the imbalance floor must be a size >= 0, got -1 MiB")
    assert main(["report", str(runs / "buffer/4"), "--imbalance-fraction", "1.5"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "rankmem report: error: the imbalance fraction must be between 0 and 1, got 1.5")


def test_a_balanced_run_flags_no_rank(runs: Path) -> None:
    for seed in BALANCED:
        run = read_run(str(runs / "balanced" / str(seed)))
        flagged = [e for e in rank_excess(run, floor_gib=LOW_FLOOR) if e.flagged]
        assert flagged == [], (seed, flagged)
        noted = [e for e in rank_excess(run) if e.noted]
        assert noted == [], (seed, noted)
