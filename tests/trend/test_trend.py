"""Leak statistics: the statistics against scipy, verdicts on known series, the bar, the online watch."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import rankmem
from rankmem.core.records import StepRecord
from rankmem.errors import RankmemError
from rankmem.publish.leakwatch import LeakWatch
from rankmem.trend.stats import mann_kendall, running_median, theil_sen
from rankmem.trend.trend import LeakConfig, trend
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


def test_a_clean_drift_is_judged_against_what_is_at_stake() -> None:
    n = 400
    values = 10.0 + np.arange(n) * 0.02 * MIB_IN_GIB  # perfectly clean, but only 4 MiB over the window
    t = trend(np.arange(n), values, RSS, 0)
    assert t is not None and t.p_value < 1e-6 and t.noise_mib == 0 and not t.leak
    assert t.bar_mib == 8.0  # no capacity known: min_growth_mib
    assert t.reason == "growth +4.0 MiB is under the bar of 8.0 MiB (3 x 0.0 MiB noise + 8.0 MiB at stake)"
    # The floor is a share of what the series grows into: 1e-4 of 80 GiB is 8.2 MiB; of 16 GiB 1.6 MiB,
    # raised to the 4 MiB rankmem's own memory may settle into.
    values = 10.0 + np.arange(n) * 0.03 * MIB_IN_GIB  # 6 MiB over the window
    big = trend(np.arange(n), values, RSS, 0, capacity_gib=80.0)
    small = trend(np.arange(n), values, RSS, 0, capacity_gib=16.0)
    assert big is not None and not big.leak and big.bar_mib == pytest.approx(8.192)
    assert small is not None and small.leak and small.bar_mib == pytest.approx(4.0)


def test_the_bar_scales_with_the_noise() -> None:
    n, rng = 100, np.random.default_rng(3)
    ramp = 10.0 + np.arange(n) * 1.0 * MIB_IN_GIB  # 1 MiB/step: 49 MiB over the last 50 steps
    clean = trend(np.arange(n), ramp + rng.normal(0, 2, n) * MIB_IN_GIB, RSS, 0)
    assert clean is not None and clean.leak and clean.noise_mib < 4
    noisy = trend(np.arange(n), ramp + rng.normal(0, 20, n) * MIB_IN_GIB, RSS, 0)
    assert noisy is not None and noisy.p_value < 0.01 and not noisy.leak  # significant, but not above the noise
    assert noisy.bar_mib > 3 * 18 and noisy.reason.startswith("growth +")
    assert "MiB is under the bar of" in noisy.reason


def test_running_median_keeps_the_length_and_drops_spikes_at_the_ends() -> None:
    y = np.zeros(30)
    y[[0, 15, 29]] = 100.0
    assert running_median(y[:, None])[:, 0].tolist() == [0.0] * 30
    step = np.r_[np.zeros(15), np.ones(15)]
    assert running_median(step[:, None])[:, 0].tolist() == step.tolist()


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


def test_leak_watch_does_not_warn_for_a_level_shift_over_many_seeds() -> None:
    # Seeds 20-79, each a pair of ranks: a +120 MiB cache allocated once at step 420, and a 1 MiB/step
    # leak. Judged online every 5 collects from step 100 on (~100 tests each): every shift stays quiet.
    n, seeds = 600, range(20, 80)
    values = np.column_stack([noisy(n, 2, seed=s) for s in seeds])
    values[420:, 0::2] += 120 * MIB_IN_GIB
    values[:, 1::2] += np.arange(n)[:, None] * 1.0 * MIB_IN_GIB
    watch = LeakWatch(check_every=5, capacity=n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(n):
            watch.feed_matrix(step, [RSS], values[step][:, None])
        watch.check()
    assert sorted(rank for _, rank in watch.flagged) == list(range(1, 2 * len(seeds), 2))


def _record(step: int, rss: list[float | None]) -> StepRecord:
    return StepRecord(step=step, time=0.0, metrics={}, ranks={RSS: rss})


def test_leak_watch_warns_once_naming_rank_and_rate() -> None:
    watch = LeakWatch(check_every=50, warmup=100)
    rng = np.random.default_rng(4)
    flagged = []
    with pytest.warns(RuntimeWarning,
                      match=r"possible memory leak on rank 1 mem/host/rss_gib: \+(3\.9|4\.0)\d\d MiB/step") as rec:
        for step in range(300):
            noise = rng.normal(0, 5, 2) * MIB_IN_GIB
            flagged += watch.feed(_record(step, [10.0 + noise[0], 10.0 + step * 4 * MIB_IN_GIB + noise[1]]))
    assert len([w for w in rec if "possible memory leak" in str(w.message)]) == 1
    assert [(t.key, t.rank) for t in flagged] == [(RSS, 1)]


def test_leak_watch_judges_everyone_once_then_spreads_its_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    import rankmem.trend.trend as trend_module

    tested: list[list[tuple[str, int]]] = []
    windows: list[int] = []
    real = trend_module.trends

    def counting(steps: np.ndarray, columns: np.ndarray, key: str, ranks: list[int], config: LeakConfig,
                 capacity_gib: object = None) -> list[trend_module.Trend]:
        tested[-1].extend((key, r) for r in ranks)
        windows.append(len(steps))
        return real(steps, columns, key, ranks, config, capacity_gib)  # type: ignore[arg-type]

    import rankmem.publish.leakwatch as leakwatch_module

    monkeypatch.setattr(leakwatch_module, "trends", counting)  # where the watch looks it up
    world, keys = 64, sorted([*trend_module.LEAK_KEYS, "loss"])
    series = world * len(trend_module.LEAK_KEYS)
    watch = LeakWatch(check_every=20)  # warm-up 50: the first whole window is collects 50..99
    rng = np.random.default_rng(6)
    for step in range(300):
        tested.append([])
        watch.feed_matrix(step, keys, 10.0 + rng.normal(0, 0.01, (world, len(keys))))
    everyone = sorted((k, r) for k in trend_module.LEAK_KEYS for r in range(world))
    assert tested[:99] == [[]] * 99  # no window reaches into the warm-up
    assert sorted(tested[99]) == everyone and windows[0] == 50  # collect 100: all at once, on steps 50..99
    # Then each series once every min(20, window / 4) collects: 12 at collect 101, 20 from collect 160.
    assert series // 12 <= max(len(feed) for feed in tested[100:]) <= -(-series // 12)
    assert {len(feed) for feed in tested[200:300]} == {series // 20, -(-series // 20)}  # over 20 collects
    assert sorted(s for feed in tested[280:300] for s in feed) == everyone
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
        monitor.close()  # inside: the leak watch runs on the publisher thread, which close() drains
    messages = [str(w.message) for w in caught if "possible memory leak" in str(w.message)]
    assert len(messages) == 1 and "rank 0 mem/host/rss_gib" in messages[0]


def test_monitor_without_sinks_builds_no_per_rank_lists() -> None:
    monitor = rankmem.Monitor(device="cpu", children=False)  # leak_check on, no sinks
    for step in range(3):
        with monitor.step(step):
            pass
        monitor.collect({"loss": 1.5})
    assert monitor._publisher._last_record is None  # the leak watch read the gathered matrix instead
    record = monitor.last_record  # still built on demand
    assert record is not None and record.step == 2 and record.ranks["loss"] == [1.5]
    monitor.close()


def test_leak_watch_warning_names_the_phase_and_when_memory_runs_out() -> None:
    rng = np.random.default_rng(2)
    keys = [RSS, "mem/node/available_gib", "mem/phase/rollout/rss_delta_gib", "mem/phase/update/rss_delta_gib"]
    watch = LeakWatch(ranks_per_node=2)
    with pytest.warns(RuntimeWarning) as caught:
        for step in range(120):
            rss = 10.0 + rng.normal(0, 0.5, 2) * MIB_IN_GIB + np.array([0.0, step * 2.0 * MIB_IN_GIB])
            update = rng.normal(0, 0.5, 2) * MIB_IN_GIB + np.array([0.0, 2.0 * MIB_IN_GIB])
            matrix = np.column_stack([rss, [8.0, 8.0], rng.normal(0, 0.5, 2) * MIB_IN_GIB, update])
            watch.feed_matrix(step, keys, matrix, when=1000.0 + 2.0 * step)  # 2 s per step
    (message,) = [str(w.message) for w in caught if "possible memory leak" in str(w.message)]
    t = watch.flagged[(RSS, 1)]
    assert t.phase == "update" and t.exhaustion is not None
    assert t.exhaustion.step == pytest.approx(99 + 8 * 1024 / t.slope_mib, abs=1)  # flagged at the first judgement
    assert re.search(r"on rank 1 mem/host/rss_gib: \+(1\.9|2\.0)\d\d MiB/step .*; growth is left behind by phase "
                     r"'update'; projected to exhaust the node's available memory at step ~4,\d\d0 \(~2\.\d h\)$",
                     message), message
