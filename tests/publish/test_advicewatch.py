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
        matrix = np.column_stack([rss, np.full(2, node_gib / 2), np.full(2, node_gib / 2), peak, t])
        given += watch.feed_matrix(step, KEYS, matrix)
    return given


def test_it_warns_once_when_the_fitted_peak_crosses_and_not_before() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Two ranks on one node of 10 GiB: 5 GiB each, 4.75 usable; rank 1 reaches ~5.3 GiB at T ~ 4000.
        given = feed(AdviceWatch(ranks_per_node=2), node_gib=10.0)
        quiet = feed(AdviceWatch(ranks_per_node=2), node_gib=16.0)  # 7.6 GiB usable each
    assert len(given) == 1 and quiet == []
    assert given[0].startswith("rankmem: phase update: the fitted peak at its heaviest micro-batch seen (")
    assert given[0].endswith("over capacity minus headroom (4.750 of 5.000 GiB): lower its token budget "
                             "(rankmem advise RUN says how far)")
    assert [str(w.message) for w in caught] == given
