"""A real 3-process gloo group under torchrun: aggregation values, caller metrics, mismatched keys."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from rankmem.core.units import GIB, MIB
from tests.conftest import REPO, torchrun

WORLD = 3


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("gather")
    proc = torchrun(REPO / "tests/dist_scripts/gather_worker.py", WORLD, [str(out)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_every_rank_gets_the_same_aggregate(results: list[dict[str, Any]]) -> None:
    for r in results[1:]:
        assert r["first"] == results[0]["first"]
        assert r["mixed"] == results[0]["mixed"]
        assert r["dict"] == results[0]["dict"]


def test_caller_metrics_max_min_mean_max_rank(results: list[dict[str, Any]]) -> None:
    m = results[0]["first"]
    assert (m["tokens/max"], m["tokens/min"], m["tokens/mean"], m["tokens/max_rank"]) == (300, 100, 200, 2)
    assert (m["loss/max"], m["loss/min"], m["loss/max_rank"]) == (2.5, 0.5, 2)
    assert m["loss/mean"] == pytest.approx(1.5)


def test_memory_aggregates_name_the_right_ranks(results: list[dict[str, Any]]) -> None:
    m = results[0]["first"]
    # Rank r holds (r + 1) * 64 MiB: rank 2 has the most RSS, rank 0 the least.
    assert m["mem/host/rss_gib/max_rank"] == 2
    spread = (m["mem/host/rss_gib/max"] - m["mem/host/rss_gib/min"]) * GIB
    assert abs(spread - 128 * MIB) < 24 * MIB
    # Held + spike: rank 0 peaks at 64 + 384 MiB, rank 1 at 128 + 256, rank 2 at 192 + 128.
    assert m["mem/phase/rollout/peak_rss_gib/max_rank"] == 0
    assert m["mem/host/rss_gib/min"] <= m["mem/host/rss_gib/mean"] <= m["mem/host/rss_gib/max"]
    assert m["perf/cpu_memory_used_gb"] == m["mem/host/rss_gib/max"]


def test_steady_state_is_one_tensor_collective(results: list[dict[str, Any]]) -> None:
    r = results[0]
    assert r["fallbacks_after_first"] == 1  # the first call learns the layout
    assert r["fallbacks_after_second"] == 1  # the second took the fast path
    assert r["second_tokens_max"] == 300


def test_a_rank_with_an_extra_key_does_not_hang_or_mix(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["fallbacks_after_mixed"] == 2
        m = r["mixed"]
        assert (m["extra/max"], m["extra/min"], m["extra/mean"], m["extra/max_rank"]) == (7.0, 7.0, 7.0, 1)
        assert m["tokens/mean"] == 1.0
        assert "extra/max" in m and len(m) == len(results[0]["mixed"])
        assert any("different keys ['extra']" in w for w in r["mixed_warnings"])


def test_a_nan_on_one_rank_is_seen_not_averaged_away(results: list[dict[str, Any]]) -> None:
    m = results[0]["nan_loss"]
    assert math.isnan(m["loss/max"]) and math.isnan(m["loss/min"]) and math.isnan(m["loss/mean"])
    assert m["loss/max_rank"] == 0  # the rank whose loss diverged


def test_allgather_dict_into_dict_in_rank_order(results: list[dict[str, Any]]) -> None:
    # As verl's own: per key, each rank's value in rank order, a rank's list kept whole.
    assert results[0]["dict"] == {"a": [0.0, 1.0, 2.0], "lst": [[0.0, 0.0], [1.0, 10.0], [2.0, 20.0]]}


# ---- the gather's device: NCCL gathers on the device the rank set for itself --------------------------
# No NCCL here: these check where PackedGather would put its tensors, through a fake torch.cuda.

def test_a_monitor_built_before_set_device_gathers_on_the_right_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    import rankmem
    from rankmem.testing import FakeCuda

    monkeypatch.setenv("LOCAL_RANK", "2")
    cuda = FakeCuda(devices=4)
    monitor = rankmem.Monitor(sinks=(), device_module=cuda, children=False)
    cuda.set_device(2)  # after the Monitor, before the first collect
    assert cuda.contexts_created == {2: 1}  # building the Monitor touched cuda:0, another rank's GPU, not at all
    gather = monitor._exchange.packed
    assert gather.resolve_device("gloo") == ("cpu", None)  # gloo gathers CPU tensors
    assert gather.resolve_device("nccl") == ("cuda", 2)
    gather._backend = "nccl"  # what _setup reads from the process group
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gather._follow_device()
    assert str(gather._device) == "cuda:2" and not caught


def test_a_gather_on_another_ranks_device_warns_once_and_follows_set_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    from rankmem.exchange.dist import _check_local_device
    from rankmem.exchange.packed import PackedGather
    from rankmem.testing import FakeCuda

    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _check_local_device("cuda", 1, 2) is None
    assert _check_local_device("cuda", 0, 1) is None  # one visible device per rank: all on cuda:0 by design
    cuda = FakeCuda(devices=2)
    gather = PackedGather(None, ("cuda", 0), device_module=cuda)  # a pair's index is ignored
    gather._backend = "nccl"
    with pytest.warns(RuntimeWarning, match=r"LOCAL_RANK=1 but this rank gathers on cuda:0, its current device"):
        gather._follow_device()  # the rank never called set_device
    gather._width = 7
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gather._follow_device()  # the same device: nothing rebuilt, no second warning
    assert gather._width == 7 and not caught
    cuda.set_device(1)
    gather._follow_device()
    assert str(gather._device) == "cuda:1" and gather._width == -1  # the buffers move with the device



_WORKER = r'''
import json, math, sys, warnings
import numpy as np
import torch
import torch.distributed as dist
from rankmem.exchange.exchange import Exchange

rank, out = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + sys.argv[3], rank=rank, world_size=2)
ex = Exchange()
res = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    # step 0: rank 1 lacks "b" (a real mixed-key collect: the union becomes the agreed layout)
    g0 = ex.gather_aggregate({"a": 1.0, "b": 2.0} if rank == 0 else {"a": 1.0}, step=0)
    n0 = len(caught)
    # step 1: no rank has "b" any more; every rank sends the same keys
    g1 = ex.gather_aggregate({"a": 1.0}, step=1)
    res["step1_warnings"] = [str(w.message) for w in caught[n0:]]
    res["step1_mixed"] = g1.mixed
dist.barrier()
dist.destroy_process_group()
json.dump(res, open(out, "w"))
'''



def _run_pair(tmp_path: Path, worker: str) -> list[dict]:
    import os
    import subprocess
    import sys

    script = tmp_path / "worker.py"
    script.write_text(worker)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / f"r{r}.json"), str(store)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]



def test_keys_that_every_rank_dropped_together_give_no_mixed_keys_warning(tmp_path: Path) -> None:
    """After one mixed-key collect the union is the agreed layout; when later every rank lacks one of
    its keys alike, _aggregate_matrix takes the mixed branch anyway: it warns "ranks reported different
    keys []" (an empty list: no rank differs) and marks the collect mixed."""
    for r in _run_pair(tmp_path, _WORKER):
        assert r["step1_warnings"] == [] and r["step1_mixed"] is False, r
