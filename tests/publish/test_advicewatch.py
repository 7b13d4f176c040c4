"""The online advice watch: one warning per phase when the fitted peak at the heaviest micro-batch seen
crosses capacity minus headroom, none while it stays under."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np

from rankmem.core.catalogue import key_of, phase_key, work_key
from rankmem.publish.advicewatch import AdviceWatch
from tests.conftest import REPO

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


FIRST_JUDGE = """
import numpy as np
from rankmem.core.catalogue import key_of, phase_key, work_key
from rankmem.publish.advicewatch import AdviceWatch

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

keys = [key_of("rss"), key_of("node_used"), key_of("node_available"), phase_key("update", "peak_rss_gib"),
        work_key("update", "mb_tokens")]
rng = np.random.default_rng(0)
rows = []
for step in range(10):
    t = rng.uniform(1000, 4000, 2)
    peak = 1.0 + 0.1 + t * 1e-5 + rng.normal(0, 1 / 1024, 2)
    rows.append(np.column_stack([np.ones(2), np.full(2, 8.0), np.full(2, 8.0), peak, t]))
watch = AdviceWatch(ranks_per_node=2)
blank = watch.primed
watch.feed_matrix(0, keys[:4], rows[0][:, :4])  # a collect without micro-batch tokens
untold = watch.primed
for step in range(8):
    watch.feed_matrix(step, keys, rows[step])
assert watch.fed == 9
before = rss()
watch.feed_matrix(8, keys, rows[8])  # the 10th collect: the first judge, the first real fit
print(blank, untold, watch.primed, rss() - before, len(watch.history))
"""


def test_the_first_judge_adds_nothing_to_the_ranks_memory() -> None:
    """A first fit costs the process ~2 MiB of numpy's workspaces for good (measured: 2.2 MiB); the watch
    takes it at the first collect with micro-batch tokens, so the 10th collect's judge, in the middle of
    the windows a fit reads, adds under 0.5 MiB. In a fresh process: the cost is once per process."""
    proc = subprocess.run([sys.executable, "-c", FIRST_JUDGE], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    blank, untold, primed, grew, histories = proc.stdout.split()
    assert (blank, untold, primed, histories) == ("False", "False", "True", "2")
    assert int(grew) < 512 * 1024, f"the first judge grew the process by {int(grew) / 2**20:.2f} MiB"
