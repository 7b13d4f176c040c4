"""The aggregation math on matrices the test builds, against per-column figures computed by hand."""

from __future__ import annotations

import math

import numpy as np

from rankmem.exchange.aggregate import aggregate


def test_each_key_gets_its_own_figures_and_the_ranks_holding_them() -> None:
    matrix = np.array([[1.0, 7.0, -2.0], [4.0, 3.0, -2.0], [2.5, 9.0, -5.0]])
    got = aggregate(["a", "b", "c"], matrix)
    assert list(got) == [f"{k}/{s}" for k in "abc" for s in ("max", "min", "mean", "max_rank", "min_rank")]
    assert [got[f"a/{s}"] for s in ("max", "min", "mean", "max_rank", "min_rank")] == [4.0, 1.0, 2.5, 1.0, 0.0]
    assert [got[f"b/{s}"] for s in ("max", "min", "mean", "max_rank", "min_rank")] == [9.0, 3.0, 19 / 3, 2.0, 1.0]
    assert [got[f"c/{s}"] for s in ("max", "min", "mean", "max_rank", "min_rank")] == [-2.0, -5.0, -3.0, 0.0, 2.0]


def test_a_result_edited_by_its_caller_leaves_the_next_one_alone() -> None:
    """Each result is a copy of the layout's cached dict: editing one must not reach the next."""
    keys = ["x", "y"]
    first = aggregate(keys, np.array([[1.0, 2.0], [3.0, 4.0]]))
    first["x/max"] = 999.0
    first.pop("y/min")
    second = aggregate(keys, np.array([[5.0, 6.0], [7.0, 0.5]]))
    assert second["x/max"] == 7.0 and second["y/min"] == 0.5 and second["y/min_rank"] == 1.0


def test_absent_ranks_are_left_out_and_a_key_no_rank_has_is_nan() -> None:
    matrix = np.array([[1.0, 5.0, 0.0], [8.0, 2.0, 0.0]])
    absent = np.array([[False, True, True], [False, False, True]])
    got = aggregate(["p", "q", "r"], matrix, absent=absent)
    assert (got["p/max"], got["p/mean"], got["p/max_rank"]) == (8.0, 4.5, 1.0)
    assert (got["q/max"], got["q/min"], got["q/mean"], got["q/min_rank"]) == (2.0, 2.0, 2.0, 1.0)
    assert all(math.isnan(got[f"r/{s}"]) for s in ("max", "min", "mean"))
    assert got["r/max_rank"] == got["r/min_rank"] == -1.0
