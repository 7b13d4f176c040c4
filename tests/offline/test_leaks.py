"""Leak detection over a run log: per rank and key, judged together or alone alike; ``rankmem leaks``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from rankmem.cli import main
from rankmem.offline import read_run
from rankmem.offline.leaks import LeakConfig, detect_leaks, trend
from rankmem.trend.trend import trends
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


def test_one_level_shift_is_not_a_leak_while_a_leak_on_another_rank_is_over_many_seeds(tmp_path: Path) -> None:
    n, seeds = 800, range(20, 80)
    flagged = np.zeros((len(seeds), 4), dtype=int)
    for i, seed in enumerate(seeds):
        rss = noisy(n, 4, seed=seed)
        rss[550:, 1] += 150 * MIB_IN_GIB  # rank 1: a cache allocated once in the window, then flat
        rss[:, 2] += np.arange(n) * 0.5 * MIB_IN_GIB  # rank 2: a real leak, 0.5 MiB/step
        rss[600:, 3] += 150 * MIB_IN_GIB + np.arange(n - 600) * 1.0 * MIB_IN_GIB  # rank 3: a jump, then a leak
        found = trends(np.arange(n), rss, RSS, range(4), LeakConfig())  # the ranks judged in one pass
        flagged[i] = [t.leak for t in found]
        shift = found[1]
        # Growing, significantly, never falling: only the shape (or its noise) tells the shift from a leak.
        assert shift.p_value < 0.01 and shift.drawdown_mib < 0.5 * shift.growth_mib and shift.reason, seed
        assert found[2].reason == found[3].reason == ""
    assert flagged.sum(axis=0).tolist() == [0, 0, len(seeds), len(seeds)]
    # In a run log, alone or together alike.
    write_run(tmp_path, {RSS: rss})
    together = detect_leaks(read_run(str(tmp_path)), keys=[RSS])
    assert together == [trend(np.arange(n), rss[:, r], RSS, r) for r in range(4)]
    assert re.search(r"mostly in \d jump\(s\) \(.*\+1\d\d\.\d MiB at step 55\d|growth \+", together[1].reason)


def test_a_staircase_of_shifts_is_not_a_leak() -> None:
    n = 400
    for seed in range(10):
        rss = noisy(n, 1, seed=seed)[:, 0]
        for at, size in ((230, 60), (300, 90), (350, 70)):
            rss[at:] += size * MIB_IN_GIB
        t = trend(np.arange(n), rss, RSS, 0)
        assert t is not None and t.growth_mib > 100 and not t.leak, t
        assert re.search(r"mostly in [23] jump\(s\)", t.reason), t.reason


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


def _leaking_job(out: Path, n: int = 100) -> Path:
    """4 ranks on one node, 1 s per step: rank 1's RSS leaks 1 MiB/step in its update phase; rank 2's
    device allocated leaks 2 MiB/step on an 80 GiB device with 2 GiB used by others."""
    rng = np.random.default_rng(5)
    rss = 10.0 + rng.normal(0, 0.5, (n, 4)) * MIB_IN_GIB
    rss[:, 1] += np.arange(n) * 1.0 * MIB_IN_GIB
    update = rng.normal(0, 0.5, (n, 4)) * MIB_IN_GIB
    update[:, 1] += 1.0 * MIB_IN_GIB  # what the update phase leaves behind, each step
    rollout = rng.normal(0, 0.5, (n, 4)) * MIB_IN_GIB  # gives back what it takes
    allocated = 10.0 + rng.normal(0, 0.25, (n, 4)) * MIB_IN_GIB
    allocated[:, 2] += np.arange(n) * 2.0 * MIB_IN_GIB
    return write_run(out, {
        RSS: rss,
        "mem/phase/update/rss_delta_gib": update,
        "mem/phase/rollout/rss_delta_gib": rollout,
        "mem/node/available_gib": np.full((n, 4), 20.0),
        "mem/node/used_gib": np.full((n, 4), 44.0),
        "mem/device/allocated_gib": allocated,
        "mem/device/total_gib": np.full((n, 4), 80.0),
        "mem/device/other_gib": np.full((n, 4), 2.0),
    })


def test_a_leak_names_its_phase_and_when_memory_runs_out(tmp_path: Path) -> None:
    _leaking_job(tmp_path)
    leaks = [t for t in detect_leaks(read_run(str(tmp_path))) if t.leak]
    assert [(t.key, t.rank) for t in leaks] == [(RSS, 1), ("mem/device/allocated_gib", 2)]
    host, device = leaks
    assert host.phase == "update" and device.phase is None  # no allocated_delta keys in this log
    # Host: the node's 20 GiB available at ~1 MiB/step (rank 1 is the node's only leak), 1 s per step.
    assert host.exhaustion is not None and host.exhaustion.capacity == "the node's available memory"
    assert host.exhaustion.headroom_mib == 20 * 1024
    assert host.exhaustion.step == pytest.approx(99 + 20 * 1024 / host.slope_mib, abs=1)
    assert host.exhaustion.seconds == pytest.approx(20 * 1024 / host.slope_mib, rel=1e-6)
    assert re.search(r"\+1\.0\d\d MiB/step .*; growth is left behind by phase 'update'; projected to exhaust "
                     r"the node's available memory at step ~20,[3-7]00 \(~5\.[6-8] h\)$",
                     host.describe()), host.describe()
    # Device: 80 - 2 GiB others - ~10.2 GiB allocated, at 2 MiB/step.
    assert device.exhaustion is not None and device.exhaustion.capacity == "device memory (total - other)"
    assert device.exhaustion.headroom_mib == pytest.approx((80 - 2 - 10 - 99 * 2 / 1024) * 1024, abs=2)
    assert "projected to exhaust device memory (total - other) at step ~34," in device.describe()
    # The stakes floor is a share of what each series grows into: 1e-4 of 64 GiB / 4 ranks (1.6 MiB,
    # raised to the 4 MiB rankmem's own memory may settle into), of 80 GiB.
    assert host.bar_mib - 3 * host.noise_mib == pytest.approx(4.0)
    assert device.bar_mib - 3 * device.noise_mib == pytest.approx(1e-4 * 80 * 1024)


def test_host_memory_runs_out_sooner_when_several_ranks_on_the_node_leak(tmp_path: Path) -> None:
    n = 100
    rss = 10.0 + np.random.default_rng(1).normal(0, 0.5, (n, 2)) * MIB_IN_GIB + np.arange(n)[:, None] * MIB_IN_GIB
    write_run(tmp_path, {RSS: rss, "mem/node/available_gib": np.full((n, 2), 10.0),
                         "mem/node/cgroup_limit_gib": np.full((n, 2), 16.0),
                         "mem/node/cgroup_working_set_gib": np.full((n, 2), 12.0)})
    a, b = detect_leaks(read_run(str(tmp_path)), keys=[RSS])
    assert a.exhaustion is not None and b.exhaustion is not None
    # The cgroup's 4 GiB left, drawn by both ranks together: ~2 MiB/step.
    assert a.exhaustion.capacity == "the cgroup's memory limit" and a.exhaustion.headroom_mib == 4 * 1024
    assert a.exhaustion.rate_mib == b.exhaustion.rate_mib == pytest.approx(a.slope_mib + b.slope_mib)
    assert a.exhaustion.step == pytest.approx(99 + 4096 / (a.slope_mib + b.slope_mib), abs=1)


def test_leaks_cli_names_the_worst_first_and_exits_3_without_a_verdict(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    _leaking_job(tmp_path / "job")
    assert main(["leaks", str(tmp_path / "job")]) == 1
    lines = capsys.readouterr().out.splitlines()
    # The device runs out later (~34,900) than the node (~20,500): the host leak comes first.
    assert lines[0].startswith("LEAK rank 1 mem/host/rss_gib") and lines[1].startswith("LEAK rank 2 mem/device/")
    assert lines[2] == "leak found on ranks 1, 2; worst: rank 1 mem/host/rss_gib"
    assert main(["leaks", str(tmp_path / "job"), "--json"]) == 1
    first = json.loads(capsys.readouterr().out)["leaks"][0]
    assert first["phase"] == "update" and first["exhaustion"]["capacity"] == "the node's available memory"
    write_run(tmp_path / "short", {RSS: noisy(15, 2, seed=1)})
    assert main(["leaks", str(tmp_path / "short")]) == 3
    assert capsys.readouterr().out.splitlines() == ["no verdict: fewer than 20 logged steps in the window"]
    assert main(["leaks", str(tmp_path / "short"), "--json"]) == 3
    capsys.readouterr()


def test_leaks_verbose_says_why_a_clear_trend_was_dismissed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    n = 400
    rss = noisy(n, 2, seed=4)
    rss[300:, 1] += 200 * MIB_IN_GIB  # a cache allocated once
    write_run(tmp_path, {RSS: rss})
    assert main(["leaks", str(tmp_path), "-v"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # Rank 0 wanders: significant (p=6e-4), but its growth is small next to its noise.
    assert re.fullmatch(r"ok   rank 0 mem/host/rss_gib: .*, p=5\.8e-04\), \+13\.5 MiB over steps 200\.\.399; "
                        r"not flagged: growth \+13\.5 MiB is under the bar of 65\.8 MiB "
                        r"\(3 x 19\.3 MiB noise \+ 8\.0 MiB "
                        r"at stake\)", lines[0]), lines[0]
    assert re.fullmatch(r"ok   rank 1 mem/host/rss_gib: .*; not flagged: grew \+2\d\d\.\d MiB "
                        r"from step \d+ to 30\d, then held to 399: held for longer than it grew "
                        r"\(a warm-up or a cache that filled\)",
                        lines[1]), lines[1]
    assert lines[-1] == "no leak found (2 rank series checked)"


def test_leaks_help_documents_the_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["leaks", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "exit status: 1 a leak was found, 0 none was, 3 no verdict" in text


def test_report_lists_the_leaks_worst_first_with_their_outlook(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    _leaking_job(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    leaks = [line for line in capsys.readouterr().out.splitlines() if line.startswith("LEAK ")]
    assert len(leaks) == 2
    assert leaks[0].startswith("LEAK rank 1 mem/host/rss_gib: +1.0") and leaks[0].endswith(" h)")
    assert "growth is left behind by phase 'update'; projected to exhaust the node's available memory" in leaks[0]
    assert leaks[1].startswith("LEAK rank 2 mem/device/allocated_gib: +2.0")
