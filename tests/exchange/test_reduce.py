"""The all-reduce path of Exchange against the all-gather path, on the same data in a real 4-process
gloo group (the crossover forced low), plus the run log a Monitor on that path writes."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from rankmem.offline import read_run
from tests.conftest import REPO, torchrun

WORLD = 4
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
BINS = 32


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Any]:
    out = tmp_path_factory.mktemp("reduce")
    proc = torchrun(REPO / "tests/dist_scripts/reduce_worker.py", WORLD, [str(out)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return ranks, out


def _cases(results: tuple[list[dict[str, Any]], Any], rank: int = 0) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in results[0][rank]["cases"]}


def _same(x: float, y: float, key: str) -> bool:
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    if key.endswith("/mean") and math.isfinite(x):
        return abs(x - y) <= 1e-12 * max(abs(x), abs(y), 1e-300)
    return x == y


def test_reduce_gives_the_gather_aggregates(results: tuple[list[dict[str, Any]], Any]) -> None:
    for name, case in _cases(results).items():
        assert case["reduce_keys"] == case["gather_keys"], name
        assert {k for k in case["reduce"] if k.rsplit("/", 1)[1] not in QUANTILES} == case["gather"].keys(), name
        for key, value in case["gather"].items():
            assert _same(value, case["reduce"][key], key), (name, key, value, case["reduce"][key])
        assert case["mixed"][0] == case["mixed"][1], name


def test_every_rank_gets_the_same_aggregates(results: tuple[list[dict[str, Any]], Any]) -> None:
    first = _cases(results, 0)
    for rank in range(1, WORLD):
        for name, case in _cases(results, rank).items():
            assert json.dumps(case["reduce"]) == json.dumps(first[name]["reduce"]), (rank, name)


def test_ties_name_the_first_rank_and_nan_names_the_first_nan(results: tuple[list[dict[str, Any]], Any]) -> None:
    cases = _cases(results)
    steady = cases["steady"]["reduce"]
    assert (steady["a/max"], steady["a/max_rank"], steady["a/min_rank"]) == (5.0, 1, 0)
    assert cases["steady2"]["reduce"]["b/min"] == -math.inf and cases["steady2"]["reduce"]["b/min_rank"] == 2
    nan = cases["nan"]["reduce"]
    assert math.isnan(nan["a/max"]) and math.isnan(nan["a/min"]) and math.isnan(nan["a/mean"])
    assert nan["a/max_rank"] == nan["a/min_rank"] == 2
    assert nan["b/max_rank"] == 0  # the other keys are untouched


def test_mixed_keys_fall_back_once_then_stay_on_the_reduce_path(results: tuple[list[dict[str, Any]], Any]) -> None:
    cases = _cases(results)
    assert cases["first"]["fallbacks"] == 1 and cases["steady"]["fallbacks"] == 1
    assert cases["extra"]["fallbacks"] == 2 and cases["extra"]["mixed"] == [True, True]
    assert cases["union"]["fallbacks"] == 2 and cases["plain"]["fallbacks"] == 2  # no pickling in steady state
    union = cases["union"]["reduce"]
    assert (union["e/max"], union["e/min"], union["e/mean"], union["e/max_rank"]) == (10.0, 8.0, 9.0, 3)
    gone = cases["gone"]["reduce"]
    assert (gone["c/max"], gone["c/max_rank"], gone["c/mean"]) == (1e12, 0, 1e12)
    assert any("different keys" in w for w in cases["extra"]["warnings"])


def test_detail_reaches_the_detail_rank_on_cadence_and_on_request(results: tuple[list[dict[str, Any]], Any]) -> None:
    fallback = {"first", "extra"}  # a pickled gather: every rank holds the matrix anyway
    cadence = {"nan", "gone"}  # collects 3 and 6 of detail_every=3
    for rank in range(WORLD):
        cases = _cases(results, rank)
        for name, case in cases.items():
            has = case["detail"] is not None
            expected = name in fallback or (rank == 1 and name in cadence | {"forced"})
            assert has == expected, (rank, name)
            if not has:
                assert case["columns"] == {}
    detail = _cases(results, 1)["gone"]
    # The detail matrix equals the gathered one, NaN where a rank lacks a key.
    got, want = detail["detail"], detail["gather_matrix"]
    assert len(got) == WORLD
    for g_row, w_row in zip(got, want, strict=True):
        assert all((math.isnan(g) and math.isnan(w)) or g == w for g, w in zip(g_row, w_row, strict=True))


def test_run_log_without_per_rank_vectors_reads_back(results: tuple[list[dict[str, Any]], Any]) -> None:
    run = read_run(str(results[1] / "run"), metrics=True)
    # Collect 0 (the fallback), 2, 4, 6 (detail_every=2) and 5 (requested by one rank) carry the
    # per-rank vector; 1, 3 and 7 hold the aggregates only: the run's rows are the former, and
    # ``logged`` lists every collect with its aggregates.
    with_detail = [0, 2, 4, 5, 6]
    assert run.steps.tolist() == with_detail
    tokens = run.series["tokens"]
    assert tokens.shape == (len(with_detail), WORLD)
    assert tokens.tolist() == [[10.0, 20.0, 30.0, 40.0]] * len(with_detail)
    assert run.logged is not None and run.logged.steps.tolist() == list(range(8))
    assert run.logged.metrics["tokens/max"].tolist() == [40.0] * 8
    assert run.logged.metrics["tokens/max_rank"].tolist() == [3.0] * 8
    assert run.logged.metrics["tokens/mean"].tolist() == [25.0] * 8
    assert run.metrics is not None and run.metrics["tokens/max"].tolist() == [40.0] * len(with_detail)


def test_a_collect_without_detail_builds_an_aggregates_only_record() -> None:
    from rankmem.core.guard import Guard
    from rankmem.exchange.aggregate import Gathered
    from rankmem.publish.publisher import Publisher

    gathered = Gathered(["mem/host/rss_gib"], None, {"mem/host/rss_gib/max": 1.0}, mixed=False)
    assert gathered.columns() == {}
    publisher = Publisher([], leak_check=True, guard=Guard(), background=False)
    publisher.publish(3, 0.0, gathered)  # no matrix: the leak watch skips it and stays on
    assert publisher._leak_check


def test_the_crossover_knobs_are_config_fields_the_environment_overrides(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from rankmem import Monitor, MonitorConfig
    from rankmem.errors import RankmemError
    from rankmem.exchange.dist import DETAIL_EVERY, REDUCE_ABOVE
    from rankmem.exchange.exchange import Exchange

    assert (Exchange().reduce_above, Exchange().detail_every) == (REDUCE_ABOVE, DETAIL_EVERY)
    config = MonitorConfig()
    assert (config.reduce_above, config.detail_every) == (REDUCE_ABOVE, DETAIL_EVERY)
    monkeypatch.setenv("RANKMEM_REDUCE_ABOVE", "2")
    monkeypatch.setenv("RANKMEM_DETAIL_EVERY", "5")
    assert (Exchange().reduce_above, Exchange().detail_every) == (2, 5)
    assert (MonitorConfig().reduce_above, MonitorConfig().detail_every) == (2, 5)
    assert Exchange(reduce_above=7).reduce_above == 7
    monitor = Monitor(device="cpu", reduce_above=7, detail_every=3, leak_check=False, near_oom_watch=False)
    # The field over the environment.
    assert (monitor._exchange.reduce_above, monitor._exchange.detail_every) == (7, 3)
    assert monitor.config.to_header()["reduce_above"] == 7
    monitor.close()
    with pytest.raises(RankmemError, match=r"^detail_every must be a whole number >= 1, got 0$"):
        MonitorConfig(detail_every=0)
    monkeypatch.setenv("RANKMEM_REDUCE_ABOVE", "many")
    with pytest.raises(RankmemError, match="RANKMEM_REDUCE_ABOVE"):
        Exchange()


def test_quantiles_are_exact_to_one_bucket(results: tuple[list[dict[str, Any]], Any]) -> None:
    for name, case in _cases(results).items():
        columns = dict(zip(case["gather_keys"], zip(*case["gather_matrix"], strict=True), strict=True))
        for key, column in columns.items():
            got = [case["reduce"][f"{key}/{p}"] for p in QUANTILES]
            values = sorted(v for v in column if not math.isnan(v))
            lo, hi = case["gather"][f"{key}/min"], case["gather"][f"{key}/max"]
            if len(values) < len(column) and not case["mixed"][0] or not math.isfinite(hi - lo):
                assert all(math.isnan(g) for g in got), (name, key)  # a caller's NaN, or no finite range
                continue
            width = (hi - lo) / BINS
            for g, q in zip(got, QUANTILES.values(), strict=True):
                true = values[max(math.ceil(q * len(values)), 1) - 1]  # nearest rank
                assert true <= g <= true + width * (1 + 1e-9), (name, key, q, g, true)



def test_bucketed_quantiles_of_a_key_no_rank_has_raise_no_numpy_warning() -> None:
    """On the all-reduce path (and its fallback) a key every rank lacks, or all-NaN, has bottom=+inf and
    top=-inf: bucket_quantiles computes inf + (-inf) outside any errstate, so the training process gets
    "RuntimeWarning: invalid value encountered in add" from rankmem (seen in a 2-rank reduce_above=1 run)."""
    import warnings

    from rankmem.exchange.reduce import matrix_quantiles

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = matrix_quantiles(np.array([[1.0, np.nan], [2.0, np.nan]]), None, 32)
    assert np.isnan(out[1]).all()
