"""Leak detection over a run log: per rank and key, judged together or alone alike; ``rankmem leaks``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from rankmem.cli import main
from rankmem.leaks import detect_leaks, trend
from rankmem.runlog import read_run
from tests.runlog_helpers import KNOWN_LEAK_LINE, MIB_IN_GIB, known_run, noisy, write_run

RSS = "mem/host/rss_gib"


def test_leak_on_one_rank_is_flagged_on_that_rank_only(tmp_path: Path) -> None:
    n = 600
    rss = noisy(n, 4, seed=2)
    rss[:, 2] += np.arange(n) * 2.0 * MIB_IN_GIB  # 2 MiB/step on rank 2
    allocated = noisy(n, 4, seed=3) - 15.0
    write_run(tmp_path, {RSS: rss, "mem/device/allocated_gib": allocated})
    trends = detect_leaks(read_run(str(tmp_path)))
    assert len(trends) == 8  # 2 series x 4 ranks (no children key in this log)
    leaks = [t for t in trends if t.leak]
    assert [(t.key, t.rank) for t in leaks] == [(RSS, 2)]
    (leak,) = leaks
    assert leak.slope_mib == pytest.approx(2.0, abs=0.1)
    assert leak.low_mib < 2.0 < leak.high_mib
    assert (leak.first_step, leak.last_step, leak.n) == (300, 599, 300)
    assert leak.growth_mib == pytest.approx(2.0 * 299, rel=0.05)
    assert leak.confidence > 0.999


def test_one_level_shift_is_not_a_leak_while_a_leak_on_another_rank_is(tmp_path: Path) -> None:
    n = 800
    rss = noisy(n, 4, seed=21)
    rss[550:, 1] += 150 * MIB_IN_GIB  # rank 1: a cache allocated once in the window, then flat
    rss[:, 2] += np.arange(n) * 0.5 * MIB_IN_GIB  # rank 2: a real leak, 0.5 MiB/step
    rss[600:, 3] += 150 * MIB_IN_GIB + np.arange(n - 600) * 1.0 * MIB_IN_GIB  # rank 3: a jump, then a leak
    write_run(tmp_path, {RSS: rss})
    trends = detect_leaks(read_run(str(tmp_path)), keys=[RSS])  # the ranks are judged in one pass
    assert [t.rank for t in trends if t.leak] == [2, 3]
    shift = trends[1]
    # Without the level-shift check the jump would be flagged: it grows, significantly, never falls.
    assert shift.growth_mib >= 64 and shift.p_value < 0.01 and shift.drawdown_mib < 0.5 * shift.growth_mib
    assert shift.reason.startswith("level shift of +1") and "at step 5" in shift.reason
    assert trends[2].reason == trends[3].reason == ""
    alone = [trend(np.arange(n), rss[:, r], RSS, r) for r in range(4)]
    assert alone == trends


def test_ranks_judged_together_equal_ranks_judged_alone(tmp_path: Path) -> None:
    n, world = 700, 6
    rss = noisy(n, world, seed=8)
    rss[:, 1] += np.arange(n) * 1.5 * MIB_IN_GIB
    rss[::7, 4] = np.nan  # a rank with gaps has its own window: judged alone
    rss[:, 5] = np.nan  # a rank that never reported this key: no trend
    write_run(tmp_path, {RSS: rss})
    run = read_run(str(tmp_path))
    alone = [trend(run.steps, run.series[RSS][:, r], RSS, r) for r in range(world)]
    assert detect_leaks(run, keys=[RSS]) == [t for t in alone if t is not None]
    assert [t.rank for t in alone if t is not None] == [0, 1, 2, 3, 4]
    assert [t.rank for t in alone if t is not None and t.leak] == [1]


def test_leaks_flags_the_leaking_rank_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    known_run(tmp_path, leak_rank=3)
    assert main(["leaks", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert re.fullmatch(KNOWN_LEAK_LINE.format(rank=3), lines[0]), lines[0]
    assert lines[1] == "leak found on rank 3"
    assert main(["leaks", str(tmp_path), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert [(t["key"], t["rank"]) for t in out["leaks"]] == [("mem/host/rss_gib", 3)]
    assert out["leaks"][0]["slope_mib"] == pytest.approx(8.0, abs=0.5)
    assert main(["leaks", str(tmp_path), "--last", "2"]) == 2
    assert capsys.readouterr().err == "rankmem leaks: error: leak window 'last' must be at least 3 steps, got 2\n"


def test_leaks_clean_run_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    known_run(tmp_path)
    assert main(["leaks", str(tmp_path), "-v"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:4]] == [f"ok   rank {r} mem/host/rss_gib" for r in range(4)]
    assert lines[-1] == "no leak found (4 rank series checked)"
