"""Leak statistics: the statistics against scipy, verdicts on known series, the online watch."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

import rankmem
from rankmem._records import StepRecord
from rankmem._trend import LeakConfig, LeakWatch, mann_kendall, theil_sen, trend
from rankmem.errors import RankmemError
from tests.runlog_helpers import MIB_IN_GIB, noisy

RSS = "mem/host/rss_gib"
ALLOC = "mem/device/allocated_gib"


def test_theil_sen_and_mann_kendall_match_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(1)
    x = np.arange(120.0)
    y = 0.3 * x + rng.normal(0, 5, x.size)
    slope, low, high = theil_sen(x, y)
    ref = stats.theilslopes(y, x, alpha=0.95)
    assert slope == pytest.approx(ref.slope, rel=1e-12)
    assert (low, high) == pytest.approx((ref.low_slope, ref.high_slope), rel=1e-9)
    s, var, p = mann_kendall(y)
    tau = stats.kendalltau(x, y)
    assert s == pytest.approx(tau.statistic * x.size * (x.size - 1) / 2)
    assert var == pytest.approx(x.size * (x.size - 1) * (2 * x.size + 5) / 18)
    flat = rng.normal(0, 1, 200)
    _, _, p_flat = mann_kendall(flat)
    ref_p = stats.kendalltau(np.arange(200), flat, alternative="greater").pvalue
    assert p_flat == pytest.approx(ref_p, abs=0.01)  # scipy uses no continuity correction


def test_ties_and_constant_series() -> None:
    s, var, p = mann_kendall(np.zeros(50))
    assert (s, var, p) == (0.0, 0.0, 1.0)
    assert trend(np.arange(50), np.zeros(50), RSS, 0) is not None
    t = trend(np.arange(50), np.zeros(50), RSS, 0)
    assert t is not None and not t.leak and t.slope_mib == 0.0


def test_flat_and_warmup_then_flat_are_not_flagged() -> None:
    n = 800
    for seed in range(5):
        flat = noisy(n, 8, seed=10 + seed)
        warm = flat.copy()
        ramp = np.minimum(np.arange(n), 300) * 4.0 * MIB_IN_GIB  # +1.2 GiB over 300 steps, then level
        warm += ramp[:, None]
        for series in (flat, warm):
            for rank in range(8):
                t = trend(np.arange(n), series[:, rank], RSS, rank)
                assert t is not None and not t.leak, t.describe()


def test_sawtooth_cache_is_not_a_leak() -> None:
    n = 400
    saw = noisy(n, 1, seed=5)[:, 0] + (np.arange(n) % 100) * 2.0 * MIB_IN_GIB  # fills 200 MiB, then freed
    t = trend(np.arange(n), saw, RSS, 0)
    assert t is not None and t.growth_mib > 64 and t.p_value < 0.01  # growth alone would flag it
    assert t.drawdown_mib > 150 and not t.leak


def test_small_drift_below_min_growth_is_not_a_leak() -> None:
    n = 400
    values = 10.0 + np.arange(n) * 0.1 * MIB_IN_GIB  # perfectly clean, but only 20 MiB over the window
    t = trend(np.arange(n), values, RSS, 0)
    assert t is not None and t.p_value < 1e-6 and not t.leak
    t = trend(np.arange(n), values, RSS, 0, LeakConfig(min_growth_mib=10))
    assert t is not None and t.leak


def test_too_short_gives_no_verdict() -> None:
    assert trend(np.arange(19), np.arange(19.0), RSS, 0) is None  # fewer than min_steps=20
    t = trend(np.arange(30), np.arange(30.0), RSS, 0)
    assert t is not None and t.n == 20  # half of 30 is too few: the window grows to min_steps
    t = trend(np.arange(100), np.arange(100.0), RSS, 0, LeakConfig(last=25))
    assert t is not None and (t.first_step, t.n) == (75, 25)


def test_config_validation() -> None:
    with pytest.raises(RankmemError, match="leak window must be a fraction in"):
        LeakConfig(window=0)
    with pytest.raises(RankmemError, match="alpha must be in"):
        LeakConfig(alpha=1.5)


def test_leak_watch_does_not_warn_for_a_level_shift() -> None:
    n = 600
    values = noisy(n, 2, seed=22)
    values[420:, 0] += 120 * MIB_IN_GIB
    values[:, 1] += np.arange(n) * 1.0 * MIB_IN_GIB
    watch = LeakWatch(check_every=1, warmup=300, capacity=n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(n):
            watch.feed_matrix(step, [RSS], values[step][:, None])
        watch.check()
    assert list(watch.flagged) == [(RSS, 1)]


def _record(step: int, rss: list[float | None]) -> StepRecord:
    return StepRecord(step=step, time=0.0, metrics={}, ranks={RSS: rss})


def test_leak_watch_warns_once_naming_rank_and_rate() -> None:
    watch = LeakWatch(check_every=50, warmup=100)
    rng = np.random.default_rng(4)
    flagged = []
    with pytest.warns(RuntimeWarning, match=r"possible memory leak on rank 1 mem/host/rss_gib: \+(3\.9|4\.0)\d\d MiB/step") as rec:
        for step in range(300):
            noise = rng.normal(0, 5, 2) * MIB_IN_GIB
            flagged += watch.feed(_record(step, [10.0 + noise[0], 10.0 + step * 4 * MIB_IN_GIB + noise[1]]))
    assert len([w for w in rec if "possible memory leak" in str(w.message)]) == 1
    assert [(t.key, t.rank) for t in flagged] == [(RSS, 1)]


def test_leak_watch_spreads_each_round_of_tests_over_check_every_feeds(monkeypatch: pytest.MonkeyPatch) -> None:
    import rankmem._trend as trend_module

    tested: list[list[tuple[str, int]]] = []
    real = trend_module.trends

    def counting(steps: np.ndarray, columns: np.ndarray, key: str, ranks: list[int], config: LeakConfig) -> list[trend_module.Trend]:
        tested[-1].extend((key, r) for r in ranks)
        return real(steps, columns, key, ranks, config)

    monkeypatch.setattr(trend_module, "trends", counting)
    world, keys = 64, sorted([RSS, ALLOC, "mem/host/children_rss_gib", "loss"])
    watch = LeakWatch(check_every=50, warmup=200)
    rng = np.random.default_rng(6)
    for step in range(300):
        tested.append([])
        watch.feed_matrix(step, keys, 10.0 + rng.normal(0, 0.01, (world, len(keys))))
    assert tested[:199] == [[]] * 199  # the warm-up is never judged
    first_round = [s for feed in tested[199:249] for s in feed]
    # 3 keys x 64 ranks, each once per 50 feeds, at most ceil(192 / 50) = 4 on any one feed.
    assert sorted(first_round) == sorted((k, r) for k in trend_module.LEAK_KEYS for r in range(world))
    assert [len(feed) for feed in tested[199:206]] == [4, 4, 4, 4, 4, 4, 3]
    assert max(len(feed) for feed in tested[199:]) == 4
    assert sum(len(feed) for feed in tested[249:299]) == 192
    assert watch.flagged == {}


def test_feed_matrix_reads_the_gathered_columns_as_feed_reads_a_record() -> None:
    by_record, by_matrix = LeakWatch(check_every=10, warmup=60), LeakWatch(check_every=10, warmup=60)
    rng = np.random.default_rng(9)
    keys = ["loss", RSS, ALLOC]  # the monitor's layout: every key, sorted or not, one row per rank
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(150):
            matrix = np.column_stack([
                rng.normal(0, 1, 4),
                10.0 + rng.normal(0, 4, 4) * MIB_IN_GIB,
                5.0 + rng.normal(0, 4, 4) * MIB_IN_GIB + np.array([0, 0, 0, 3.0]) * step * MIB_IN_GIB,
            ])
            matrix[2, 1] = np.nan  # rank 2 lacks RSS at every step (nan = absent, as union_matrix pads)
            ranks: dict[str, list[float | None]] = {
                k: [None if np.isnan(v) else float(v) for v in matrix[:, i]] for i, k in enumerate(keys)
            }
            by_record.feed(StepRecord(step=step, time=0.0, metrics={}, ranks=ranks))
            by_matrix.feed_matrix(step, keys, matrix)
    assert list(by_matrix.flagged) == [(ALLOC, 3)]
    assert by_matrix.flagged == by_record.flagged
    assert by_matrix.flagged[(ALLOC, 3)].slope_mib == pytest.approx(3.0, abs=0.2)
    assert by_matrix.check() == [] and by_record.check() == []  # warned once only
    assert sum("possible memory leak on rank 3 mem/device/allocated_gib" in str(w.message) for w in caught) == 2


def test_monitor_feeds_its_leak_watch(tmp_path: Path) -> None:
    held = []
    monitor = rankmem.Monitor(out_dir=str(tmp_path), sinks=("jsonl",), device="cpu", children=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(300):  # past the watch's 200-step warm-up
            with monitor.step(step):
                held.append(b"\x01" * (1 << 20))  # 1 MiB of touched pages kept alive: a real leak
            monitor.collect()
    monitor.close()
    messages = [str(w.message) for w in caught if "possible memory leak" in str(w.message)]
    assert len(messages) == 1 and "rank 0 mem/host/rss_gib" in messages[0]


def test_monitor_without_sinks_builds_no_per_rank_lists() -> None:
    monitor = rankmem.Monitor(device="cpu", children=False)  # leak_check on, no sinks
    for step in range(3):
        with monitor.step(step):
            pass
        monitor.collect({"loss": 1.5})
    assert monitor._last_record is None  # the leak watch read the gathered matrix instead
    record = monitor.last_record  # still built on demand
    assert record is not None and record.step == 2 and record.ranks["loss"] == [1.5]
    monitor.close()
