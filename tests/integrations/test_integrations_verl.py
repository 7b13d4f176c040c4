"""verl integration against verl's own code: its ``reduce_metrics`` and ``allgather_dict_into_dict``.

verl's package ``__init__`` imports ray (and its requirements pin transformers < 5.11), so the wheel
is installed with ``--no-deps`` and the functions are read from the installed files: the metric
module is loaded by path (it imports only numpy and torch), and ``allgather_dict_into_dict`` is
compiled from its source in ``torch_functional.py`` (whose imports need tensordict), as are the
micro-batch split of ``seqlen_balancing.py`` and the row selection it calls from
``tensordict_utils.py``. tensordict is not installed, so its ``TensorDict`` constructor is the one
thing stood in for (by ``dict``): the split, the balancing and the row selection are verl's code.
Nothing of verl is reimplemented here. Also runs as a torchrun job (``__main__``) for the 2-rank
gloo test.
"""

from __future__ import annotations

import ast
import datetime
import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def _verl_dir() -> Path | None:
    spec = importlib.util.find_spec("verl")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def load_verl_metric_utils() -> ModuleType:
    root = _verl_dir()
    if root is None:
        pytest.skip("verl is not installed: pip install --no-deps verl==0.9.1 (make install does)")
    spec = importlib.util.spec_from_file_location("_verl_metric_utils", root / "utils/metric/utils.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Metric objects must pickle by this module name
    spec.loader.exec_module(module)
    return module


def load_verl_allgather() -> Any:
    root = _verl_dir()
    if root is None:
        pytest.skip("verl is not installed: pip install --no-deps verl==0.9.1 (make install does)")
    source = (root / "utils/torch_functional.py").read_text()
    tree = ast.parse(source)
    [fn] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "allgather_dict_into_dict"]
    import torch
    import torch.distributed  # noqa: F401 - the function calls torch.distributed.*

    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(root / "utils/torch_functional.py"), "exec"), namespace)
    return namespace["allgather_dict_into_dict"]


def load_verl_split() -> Any:
    """verl's ``rearrange_micro_batches`` with the helpers it calls, compiled from the installed sources."""
    root = _verl_dir()
    if root is None:
        pytest.skip("verl is not installed: pip install --no-deps verl==0.9.1 (make install does)")
    import copy
    import heapq
    from itertools import chain

    import torch
    import torch.distributed as dist

    def functions(rel: str, names: set[str] | None) -> list[ast.stmt]:
        tree = ast.parse((root / rel).read_text())
        return [n for n in tree.body if isinstance(n, ast.FunctionDef) and (names is None or n.name in names)]

    tu: dict[str, Any] = {"torch": torch, "TensorDict": lambda source, batch_size: dict(source)}
    body = functions("utils/tensordict_utils.py", {"index_select_tensor_dict", "nested_tensor_from_tensor_list"})
    exec(compile(ast.Module(body=body, type_ignores=[]), str(root / "utils/tensordict_utils.py"), "exec"), tu)
    namespace: dict[str, Any] = {
        "torch": torch, "dist": dist, "heapq": heapq, "copy": copy, "chain": chain,
        "get_device_name": lambda: "cpu", "tu": type("tensordict_utils", (), {
            "index_select_tensor_dict": staticmethod(tu["index_select_tensor_dict"])}),
    }
    split = {"calculate_workload", "karmarkar_karp", "greedy_partition", "get_seqlen_balanced_partitions",
             "ceildiv", "roundup_divisible", "rearrange_micro_batches"}
    path = str(root / "utils/seqlen_balancing.py")
    exec(compile(ast.Module(body=functions("utils/seqlen_balancing.py", split), type_ignores=[]), path, "exec"),
         namespace)
    return namespace["rearrange_micro_batches"]


# ---- single process ------------------------------------------------------------------------------

def test_reduction_rule_is_verls() -> None:
    from rankmem.integrations.verl import verl_reduction

    verl = load_verl_metric_utils()
    for key in ["loss", "perf/max_memory_allocated_gb", "a/min", "minmax", "mem/phase/admin/peak_rss_gib/mean",
                "timing/x"]:
        reduced = verl.reduce_metrics({key: [1.0, 3.0, 2.0]})[key]
        assert reduced == {"max": 3.0, "min": 1.0, "mean": 2.0}[verl_reduction(key)], key


def test_names_reduce_to_the_right_aggregates() -> None:
    """Three monitors stand for three DP ranks; verl's reduce_metrics must give max/min/mean per key."""
    import rankmem
    from rankmem.integrations.verl import VERL_NAMES, metrics_for_gather
    from rankmem.testing import FakeCuda

    verl = load_verl_metric_utils()
    per_rank = []
    for r in range(3):
        cuda = FakeCuda()
        monitor = rankmem.Monitor(sinks=(), device_module=cuda)
        with monitor.phase("minibatch"):  # "min" in a phase name: verl would reduce its /mean by min
            h = cuda.malloc((r + 1) * 256 * 2**20)
            cuda.free(h)
        per_rank.append(metrics_for_gather(monitor))
        monitor.close()
    keys = set(per_rank[0])
    assert all(set(m) == keys for m in per_rank)
    gathered = {k: [m[k] for m in per_rank] for k in keys}  # verl's gather: one list per rank
    reduced = verl.reduce_metrics(dict(gathered))

    base = "mem/device/peak_allocated_gib"
    column = [m[base + "/max"][0] for m in per_rank]
    assert column[0] < column[1] < column[2]
    assert reduced[base + "/max"] == max(column) and reduced[base + "/min"] == min(column)
    assert reduced[base + "/mean"] == pytest.approx(sum(column) / 3)
    assert reduced["perf/max_memory_allocated_gb"] == max(column)  # a window peak, worst rank
    rss = [m["mem/host/rss_gib/max"][0] for m in per_rank]
    assert reduced["perf/cpu_memory_used_gb"] == pytest.approx(sum(rss) / 3)  # verl averages it: documented
    assert set(VERL_NAMES) <= keys
    phase = "mem/phase/minibatch/peak_allocated_gib"
    assert phase + "/max" in keys and phase + "/min" in keys and phase + "/mean" not in keys  # mean would be min
    assert reduced[phase + "/max"] == pytest.approx(768 / 1024, abs=4 / 1024)  # the 768 MiB rank, 2 MiB segments
    assert not any(k.endswith("/max_rank") for k in keys)


def test_dropin_without_process_group() -> None:
    from rankmem.integrations.verl import allgather_dict_into_dict

    assert allgather_dict_into_dict({"a": 1.0, "b": [1, 2]}) == {"a": [1.0], "b": [[1.0, 2.0]]}
    with pytest.raises(TypeError, match="expects a dict"):
        allgather_dict_into_dict([("a", 1)])  # type: ignore[arg-type]
    # Plain floats take the short road, everything else the general one: the same answers either way.
    import numpy as np

    mixed = {"f": 0.5, "fl": [0.25, 1.5], "i": 3, "il": [1, 2.5], "np": np.float32(2.0), "t": [True], "s": "x",
             "huge": [10**400], "empty": []}
    assert allgather_dict_into_dict(mixed) == {"f": [0.5], "fl": [[0.25, 1.5]], "i": [3.0], "il": [[1.0, 2.5]],
                                               "np": [2.0], "t": [[True]], "s": ["x"], "huge": [[10**400]],
                                               "empty": [[]]}


# Sequence lengths of one rank's mini-batch, padded to 64 positions; verl's split at 160 tokens.
LENGTHS = [61, 3, 40, 17, 64, 9, 33, 50, 25, 12, 47, 5]
WIDTH, BUDGET = 64, 160


def _padded_batch(left: bool) -> dict[str, Any]:
    import torch

    mask = torch.zeros(len(LENGTHS), WIDTH, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        if left:
            mask[row, WIDTH - n:] = 1  # prompts are left-padded in verl's rollout batches
        else:
            mask[row, :n] = 1
    ids = torch.randint(1, 100, (len(LENGTHS), WIDTH)) * mask
    return {"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(WIDTH).expand(len(LENGTHS), -1)}


def _expected(indices: list[list[int]]) -> dict[str, float]:
    heaviest = max(([LENGTHS[i] for i in idx] for idx in indices), key=sum)
    largest_q = max(sum(LENGTHS[i] ** 2 for i in idx) for idx in indices)
    return {"mb_tokens": sum(heaviest), "mb_sequences": len(heaviest), "mb_sq_tokens": largest_q,
            "tokens": sum(LENGTHS), "micro_batches": len(indices)}


def test_verls_own_split_reaches_the_run_log_as_work(tmp_path: Path) -> None:
    """verl's rearrange_micro_batches on a padded batch, then on a nested (remove-padding) one; the
    micro-batches themselves, and the index lists with the lengths or the mask, give the same work."""
    import torch

    import rankmem
    from rankmem.core.catalogue import WORK_FIELDS, work_key
    from rankmem.integrations.verl import tell_micro_batches
    from rankmem.offline import read_run

    rearrange = load_verl_split()
    padded = _padded_batch(left=True)
    micro_batches, indices = rearrange(padded, max_token_len=BUDGET)
    nested = {"input_ids": torch.nested.as_nested_tensor(
        [torch.arange(n) for n in LENGTHS], layout=torch.jagged)}
    nested_mbs, nested_indices = rearrange(nested, max_token_len=BUDGET)
    assert sorted(i for idx in indices for i in idx) == list(range(len(LENGTHS)))
    assert len(indices) >= 3 and all(sum(LENGTHS[i] for i in idx) <= BUDGET for idx in indices)

    monitor = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", children=False, near_oom_watch=False)
    tells = [
        lambda: tell_micro_batches(monitor, micro_batches),
        lambda: tell_micro_batches(monitor, indices, seqlens=LENGTHS),
        lambda: tell_micro_batches(monitor, indices, seqlens=padded["attention_mask"]),
        lambda: [tell_micro_batches(monitor, [mb]) for mb in nested_mbs],  # one call per micro-batch
    ]
    for step, tell in enumerate(tells):
        with monitor.step(step):
            with monitor.phase("update"):
                tell()
        monitor.collect()
    monitor.close()

    run = read_run(str(tmp_path))
    assert list(run.steps) == [0, 1, 2, 3]
    for step in range(4):
        want = _expected(nested_indices if step == 3 else indices)
        assert {f: run.series[work_key("update", f)][step, 0] for f in WORK_FIELDS} == want, step
    # The heaviest micro-batch is one verl made, not the whole batch: the split is the one measured.
    assert run.series[work_key("update", "mb_tokens")][0, 0] <= BUDGET < sum(LENGTHS)


def test_padding_rows_are_no_sequences_and_bad_input_is_one_clear_error() -> None:
    import torch

    import rankmem
    from rankmem.core.catalogue import work_key
    from rankmem.errors import RankmemError
    from rankmem.integrations.verl import tell_micro_batches

    monitor = rankmem.Monitor(device="cpu", children=False, near_oom_watch=False)
    with monitor.step(0):
        with monitor.phase("update"):
            mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]])  # a row of padding only
            tell_micro_batches(monitor, [{"attention_mask": mask}])
            with pytest.raises(RankmemError, match="holding a 2-D 'attention_mask' or nested 'input_ids', got list"):
                tell_micro_batches(monitor, [[1, 2, 3]])
            with pytest.raises(RankmemError, match="must be 2-D .* got 3-D"):
                tell_micro_batches(monitor, [{"attention_mask": mask[None]}])
            with pytest.raises(RankmemError, match="index list 1 holds 7, outside the 3 sequences of seqlens"):
                tell_micro_batches(monitor, [[0], [7]], seqlens=[4, 5, 6])
            with pytest.raises(RankmemError, match="seqlens holds a negative length"):
                tell_micro_batches(monitor, [[0]], seqlens=[-1])
    got = monitor.local_metrics()
    monitor.close()
    assert got[work_key("update", "mb_tokens")] == 5.0
    assert got[work_key("update", "mb_sequences")] == 2.0
    assert got[work_key("update", "mb_sq_tokens")] == 13.0


# ---- two ranks, real gloo -------------------------------------------------------------------------

def test_two_ranks_against_verls_gather(tmp_path: Path, run_torchrun: Any) -> None:
    if _verl_dir() is None:
        pytest.skip("verl is not installed: pip install --no-deps verl==0.9.1 (make install does)")
    proc = run_torchrun(__file__, 2, [str(tmp_path)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in results:
        assert res["same_as_verl"], res
        assert res["pickled_calls"] == res["expected_pickled_calls"]
    truth = results[0]["truth"]  # per-rank local figures, gathered by pickle as ground truth
    reduced = results[0]["reduced"]
    for key in ("mem/host/rss_gib", "mem/host/peak_rss_gib"):
        col = [t[key] for t in truth]
        assert reduced[key + "/max"] == max(col) and reduced[key + "/min"] == min(col)
        assert reduced[key + "/mean"] == pytest.approx(sum(col) / 2)
    # rank 1 holds 96 MiB more live memory than rank 0
    assert truth[1]["mem/host/rss_gib"] - truth[0]["mem/host/rss_gib"] > 80 / 1024
    for r, t in enumerate(truth):
        statm_gib = results[r]["statm_rss_gib"]
        assert abs(t["mem/host/rss_gib"] - statm_gib) < 0.05, (t["mem/host/rss_gib"], statm_gib)
    assert reduced["perf/cpu_memory_used_gb"] == pytest.approx(sum(t["mem/host/rss_gib"] for t in truth) / 2)


def _job(out: Path) -> None:
    import pickle

    import torch
    import torch.distributed as dist

    import rankmem
    from rankmem.exchange import dist as _collective
    from rankmem.integrations.verl import allgather_dict_into_dict, metrics_for_gather

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    verl_gather = load_verl_allgather()
    verl = load_verl_metric_utils()
    monitor = rankmem.Monitor(sinks=())
    held = torch.ones((1 + 96 * rank) * 2**20 // 4)  # rank 1 holds 96 MiB more
    mem = metrics_for_gather(monitor)
    truth = _collective.all_gather_objects({k[: -len("/max")]: v[0] for k, v in mem.items() if k.endswith("/max")})

    # Count pickled gathers: the first call learns the layout (1), steady state pickles nothing (0), and
    # a new layout that every rank shares and that fits the learned capacity stays on the tensor path,
    # uneven list lengths included: only its objects are pickled (1).
    calls = {"n": 0}
    real = dist.all_gather_object

    def counting(*a: Any, **k: Any) -> Any:
        calls["n"] += 1
        return real(*a, **k)

    dist.all_gather_object = counting  # type: ignore[assignment]
    cases = [
        {**mem, "actor/pg_loss": [0.5 + rank, 0.25], "lr": 1e-4, "n": 7 + rank},
        {**mem, "actor/pg_loss": [1.5 + rank, 0.5], "lr": 2e-4, "n": 8 + rank},  # steady state: no pickling
        {"actor/kl": verl.Metric("max", float(rank)), "x": [1.0] * (rank + 1)},  # objects, uneven lists
    ]
    same = True
    ours_results = []
    counts = []
    for case in cases:
        before = calls["n"]
        ours = allgather_dict_into_dict(case)
        counts.append(calls["n"] - before)
        dist.all_gather_object = real  # type: ignore[assignment]
        theirs = verl_gather(case)
        dist.all_gather_object = counting  # type: ignore[assignment]
        same &= pickle.dumps(_plain(ours)) == pickle.dumps(_plain(theirs))
        ours_results.append(ours)
    dist.all_gather_object = real  # type: ignore[assignment]
    mem_only = {k: v for k, v in ours_results[0].items() if k in mem}
    reduced = {k: float(v) for k, v in verl.reduce_metrics(mem_only).items()}
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        statm_gib = int(f.read().split()[1]) * page / 2**30
    result = {
        "same_as_verl": bool(same), "pickled_calls": counts, "expected_pickled_calls": [1, 0, 1],
        "truth": truth, "reduced": reduced, "statm_rss_gib": statm_gib,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    del held
    monitor.close()
    dist.destroy_process_group()


def _plain(value: Any) -> Any:
    """Numbers as floats and Metric objects as (aggregation, values), to compare two results exactly."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "aggregation"):
        return ("Metric", str(value.aggregation), [float(v) for v in value.values])
    return float(value) if not (isinstance(value, float) and math.isnan(value)) else "nan"


if __name__ == "__main__":
    _job(Path(sys.argv[1]))
