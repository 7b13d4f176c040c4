"""The online advice watch: one warning per phase when the fitted peak at the heaviest micro-batch seen
crosses capacity minus headroom, none while it stays under."""

from __future__ import annotations

import warnings

import numpy as np

from rankmem.core.catalogue import key_of, phase_key, work_key
from rankmem.publish.advicewatch import AdviceWatch

KEYS = [key_of("rss"), key_of("node_used"), key_of("node_available"), phase_key("update", "peak_rss_gib"),
        work_key("update", "mb_tokens")]


def feed(watch: AdviceWatch, node_gib: float, steps: int = 30) -> list[str]:
    rng = np.random.default_rng(0)
    given = []
    for step in range(steps):
        t = rng.uniform(1000, 4000, 2)
        rss = np.array([1.0, 1.2])
        peak = rss + 0.1 + t * 1e-3 + rng.normal(0, 1 / 1024, 2)  # ~1 MiB per token: up to ~5.3 GiB
        used = rss.sum() + 0.5  # the node's other processes hold 0.5 GiB
        matrix = np.column_stack([rss, np.full(2, used), np.full(2, node_gib - used), peak, t])
        given += watch.feed_matrix(step, KEYS, matrix)
    return given


def test_it_warns_once_when_the_fitted_peak_crosses_and_not_before() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Two ranks on one node of 10 GiB, 0.5 held by other processes: 4.75 GiB each, 4.513 usable; rank 1
        # reaches ~5.3 GiB at T ~ 4000.
        given = feed(AdviceWatch(["node0", "node0"]), node_gib=10.0)
        quiet = feed(AdviceWatch(["node0", "node0"]), node_gib=16.0)  # 7.36 GiB usable each
    assert len(given) == 1 and quiet == []
    assert given[0].startswith("rankmem: phase update: the fitted peak at its heaviest micro-batch seen (")
    assert given[0].endswith("over capacity minus headroom (4.513 of 4.750 GiB, node total less 0.500 GiB of "
                             "other processes / 2 ranks): lower its token budget "
                             "(rankmem advise RUN says how far)")
    assert [str(w.message) for w in caught] == given


def feed_device(watch: AdviceWatch, total_gib: float) -> list[str]:
    """One rank whose caching allocator grows its pool to 1.25x an allocation it cannot serve, on a probe
    that rises and repeats: the repeats are served from the pool, their reserved far over their own need."""
    from tests.offline.test_advice_device import BASE, FIXED, OTHER, PER_TOKEN, PROBE, RATIO

    keys = [key_of("allocated"), key_of("other"), key_of("total"), phase_key("update", "peak_allocated_gib"),
            phase_key("update", "peak_reserved_gib"), phase_key("update", "peak_reserved_rise_gib"),
            work_key("update", "mb_tokens")]
    given, pool = [], BASE
    for step, t in enumerate(PROBE * 5):
        alloc = BASE + FIXED + PER_TOKEN * t
        reserved = max(pool, alloc * RATIO)
        row = [BASE, OTHER, total_gib, alloc, reserved, reserved - pool, t]
        pool = reserved
        given += watch.feed_matrix(step, keys, np.array([row]))
    return given


def test_on_the_device_the_allocators_pool_is_not_taken_for_the_phases_overhead() -> None:
    # At the heaviest T (16384) the phase allocates 0.775 GiB: 0.969 reserved at the ratio, 1.669 with the
    # memory outside torch (~1.70 with the interval). Read as the 2048-token repeats' slack (0.74 GiB over
    # their allocation) the same peak would be 2.22 GiB: over 2.0 GiB's usable 1.9, a warning for nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quiet = feed_device(AdviceWatch(), total_gib=2.0)
        given = feed_device(AdviceWatch(), total_gib=1.7)  # usable 1.615
    assert quiet == []
    assert len(given) == 1 and "(16384 tokens, rank 0)" in given[0]
    assert "(1.615 of 1.700 GiB, device total)" in given[0]
