"""The device path of the advice: what the caching allocator holds over a window's own allocation.

The allocator keeps freed segments: a window after a larger one is served from the pool, and its reserved
peak minus its allocated peak is the earlier window's slack, not its own overhead. A probe whose T rises
and then repeats (as ``scripts/gpu_advise_check.py`` runs on a GPU) shows both kinds of window. Where the
pool grows, it grows in proportion to the allocation (the reference GPT on an H200: bench/RESULTS.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rankmem.core.catalogue import key_of, phase_key, work_key
from rankmem.offline import read_run
from rankmem.offline.advice import fit_ranks
from tests.runlog_helpers import write_run

PER_TOKEN = 40 / 2**20  # GiB: 40 KiB per token
BASE = 0.1  # GiB allocated between steps
FIXED = 0.05  # GiB the phase allocates whatever its tokens
RATIO = 1.25  # the pool grows to this multiple of the allocation that made it grow
OTHER = 0.7  # GiB outside torch (the CUDA context)
PROBE = [2048, 4096, 6144, 8192, 12288, 16384]


def caching_run(out: Path, tokens: list[int], rise_key: bool = True, small_segment_at: int | None = None) -> Path:
    """A run whose reserved pool grows when a window's allocation passes it, to RATIO times it; and by a
    2 MiB segment for small blocks at window ``small_segment_at``, whatever the pool held."""
    t = np.asarray(tokens, dtype=np.float64)
    peak_alloc = BASE + FIXED + PER_TOKEN * t
    pool, reserved, rise = BASE, [], []
    for i, need in enumerate(peak_alloc * RATIO):
        grown = max(pool, need) + (2 / 1024 if i == small_segment_at else 0.0)
        reserved.append(grown)
        rise.append(grown - pool)
        pool = grown
    col = lambda a: np.asarray(a, dtype=np.float64)[:, None]  # noqa: E731 - one rank
    series = {
        key_of("allocated"): np.full((t.size, 1), BASE),
        key_of("other"): np.full((t.size, 1), OTHER),
        key_of("total"): np.full((t.size, 1), 139.8),
        phase_key("update", "peak_allocated_gib"): col(peak_alloc),
        phase_key("update", "peak_reserved_gib"): col(reserved),
        work_key("update", "mb_tokens"): col(t),
        work_key("update", "mb_sequences"): np.ones((t.size, 1)),
        work_key("update", "mb_sq_tokens"): col(t * t),
    }
    if rise_key:
        series[phase_key("update", "peak_reserved_rise_gib")] = col(rise)
    write_run(out, series)
    return out


def expected_peak(t: float) -> float:
    return (BASE + FIXED + PER_TOKEN * t) * RATIO + OTHER


@pytest.mark.parametrize("rise_key", [True, False], ids=["rise logged", "older log: rise from the running max"])
@pytest.mark.parametrize("small_segment_at", [None, 6], ids=["", "a 2 MiB segment cut in a window the pool served"])
def test_the_overhead_is_the_slack_where_the_pool_grew_not_the_pools_slack_over_small_windows(
        tmp_path: Path, rise_key: bool, small_segment_at: int | None) -> None:
    run = read_run(caching_run(tmp_path, PROBE * 2, rise_key, small_segment_at))
    [pf] = fit_ranks(run, "update", warmup=2)
    # The second pass of the probe is served from the pool: its 2048-token window holds 0.7 GiB of slack
    # (the 16384-token window's), which is not what a window of 24576 tokens adds over its allocation.
    assert (pf.overhead_ratio, pf.extra) == (pytest.approx(RATIO), pytest.approx(OTHER))
    for t in (16384, 24576):
        assert pf.peak(t, t * t)[0] == pytest.approx(expected_peak(t), abs=1e-6)


def test_where_no_window_grew_the_pool_the_slack_at_the_largest_allocation_bounds_it(tmp_path: Path) -> None:
    # The warm-up steps ran the largest micro-batch: the pool covered every window after them.
    run = read_run(caching_run(tmp_path, [16384, 16384] + PROBE))
    [pf] = fit_ranks(run, "update", warmup=2)
    assert (pf.overhead_ratio, pf.extra) == (pytest.approx(RATIO), pytest.approx(OTHER))  # the 16384 window's
    assert pf.peak(8192, 8192**2)[0] == pytest.approx(expected_peak(8192), abs=1e-6)
