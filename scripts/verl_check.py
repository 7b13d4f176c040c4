"""verl 0.9.1's own ``TrainingWorker._postprocess_output`` with rankmem's change, on 2 ranks of verl's own
Ray worker group (gloo on CPU), driven the way verl's trainer drives it.

Run in the environment ``make verl-check`` builds (verl 0.9.1 with all its dependencies, which the
test environment cannot hold: verl pins transformers < 5.11)::

    make verl-check        # or: .venv-verl/bin/python scripts/verl_check.py

verl's code here: ``RayResourcePool``/``RayWorkerGroup`` and ``Worker`` (actors, rank environment,
rendezvous), ``initialize_global_process_group_ray`` (each rank joins the group), ``register`` with
``make_nd_compute_dataproto_dispatch_fn("train")`` (the dispatch ``train_mini_batch`` uses: the batch
split over data-parallel ranks, and on the way back the metadata-only outputs reduced to ``data[0]``
by ``concat_tensordict_with_none_bsz``), ``TrainingWorker._postprocess_output`` itself (its source read
from the installed file, rankmem's change applied, compiled in the module's own namespace, so
``allgather_dict_into_dict``, ``get_torch_device`` and ``tu`` are verl's), and ``reduce_metrics``.

Two settings differ from a verl job, because verl 0.9.1 has no CPU platform (with no accelerator
it falls back to "nvidia": ``get_device_name()`` says ``cuda``): ``initialize_global_process_group_ray``
gets ``backend="gloo"`` (its default names NCCL), and the worker's ``device_name`` is ``cpu``. Not
verl's: the engine. verl 0.9.1 registers its engines for cuda and npu only, so a CPU rank has
none; a stand-in answers the one engine call ``_postprocess_output`` makes,
``get_data_parallel_group()``, with the world group. The micro-batch metrics fed in are a fixed
``actor/pg_loss`` per rank. Rank 1 holds 256 MiB more than rank 0: the worst rank to find.

rankmem's change (README, "verl engine worker"): ``self.rankmem = Monitor(sinks=())`` in
``__init__``; ``metrics.update(metrics_for_gather(self.rankmem))`` after ``metrics`` is popped; the three
``perf/*`` lines computed after the gather removed, which leaves ``import psutil`` unused.
"""

from __future__ import annotations

import ast
import inspect
import os
import sys
import textwrap
import time
from typing import Any

BALLAST_MIB = 256
ANCHOR = 'metrics: dict = output.pop("metrics")'
ADDED = "metrics.update(metrics_for_gather(self.rankmem))"
REMOVED = (
    'final_metrics["perf/max_memory_allocated_gb"] = get_torch_device().max_memory_allocated() / (1024**3)',
    'final_metrics["perf/max_memory_reserved_gb"] = get_torch_device().max_memory_reserved() / (1024**3)',
    'final_metrics["perf/cpu_memory_used_gb"] = psutil.virtual_memory().used / (1024**3)',
)


def patched_postprocess_output() -> tuple[Any, list[str]]:
    """verl's installed ``TrainingWorker._postprocess_output`` with rankmem's change; and what was found."""
    import verl.workers.engine_workers as ew

    from rankmem.integrations.verl import metrics_for_gather

    path = inspect.getsourcefile(ew)
    assert path is not None
    text = open(path).read()
    tree = ast.parse(text)
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainingWorker"]
    [fn] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_postprocess_output"]
    assert fn.end_lineno is not None
    lines = text.splitlines()[fn.lineno - 1 : fn.end_lineno]
    stripped = [line.strip() for line in lines]
    assert stripped.count(ANCHOR) == 1, f"verl changed: {ANCHOR!r} not found once in {path}"
    at = stripped.index(ANCHOR)
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    lines.insert(at + 1, indent + ADDED)
    for line in REMOVED:
        matches = [i for i, s in enumerate(lines) if s.strip() == line]
        assert len(matches) == 1, f"verl changed: {line!r} not found once in {path}"
        del lines[matches[0]]
    rest = [s for s in text.splitlines() if s.strip() not in REMOVED]
    psutil_uses = [s.strip() for s in rest if "psutil" in s]
    notes = [f"{path}: anchor and the 3 removed lines found verbatim",
             f"psutil left in the file after the change: {psutil_uses}"]
    namespace = dict(vars(ew), metrics_for_gather=metrics_for_gather)
    tree = ast.parse(textwrap.dedent("\n".join(lines)))
    ast.increment_lineno(tree, fn.lineno - 1)  # tracebacks point into the installed file (+1 after the insert)
    exec(compile(tree, path, "exec"), namespace)
    return namespace["_postprocess_output"], notes


def make_worker_class() -> type:
    import psutil
    import torch
    import torch.distributed as dist
    from tensordict import TensorDict
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import (
        Dispatch,
        make_nd_compute_dataproto_dispatch_fn,
        register,
    )
    from verl.utils.distributed import initialize_global_process_group_ray

    from rankmem import Monitor

    class WorldEngine:
        """The stand-in engine: data parallel over the whole world."""

        def get_data_parallel_group(self) -> Any:
            return dist.group.WORLD

    class CheckWorker(Worker):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            # verl's default backend, "cpu:gloo,<device>:<its backend>", asks a CPU-only torch for NCCL.
            initialize_global_process_group_ray(timeout_second=120, backend="gloo")
            self.rankmem = Monitor(sinks=())  # the README's line in TrainingWorker.__init__
            self.engine = WorldEngine()
            self.device_name = "cpu"  # what TrainingWorker sets from get_device_name(), which says cuda here
            self.flops_counter = None
            self._register_dispatch_collect_info(mesh_name="train", dp_rank=self.rank, is_collect=True)
            self.postprocess, self.notes = patched_postprocess_output()
            self.ballast = bytearray(BALLAST_MIB << 20) if self.rank == 1 else None  # zero-filled: resident

        @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"))
        def train_batch(self, data: TensorDict) -> TensorDict:
            x = data["x"].double()
            output = {"metrics": {"actor/pg_loss": [float(x.mean())]}, "loss": [x.sum() / 8], "model_output": {}}
            return self.postprocess(self, output, global_token_num=None, delta_time=1.0, forward_only=False,
                                    images_seqlens=None)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def unpatched(self) -> dict[str, Any] | str:
            """What verl 0.9.1's own method, unchanged, reports on this CPU rank: its perf/* keys."""
            import verl.workers.engine_workers as ew
            from verl.utils import tensordict_utils as tu

            output = {"metrics": {"actor/pg_loss": [0.0]}, "loss": [torch.tensor(0.0)], "model_output": {}}
            try:
                out = ew.TrainingWorker._postprocess_output(self, output, global_token_num=None, delta_time=1.0,
                                                            forward_only=False, images_seqlens=None)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                return f"{type(exc).__name__}: {exc}"
            return {k: v for k, v in tu.get(out, "metrics").items() if k.startswith("perf/")}

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def facts(self) -> dict[str, Any]:
            return {"rss": psutil.Process().memory_info().rss, "notes": self.notes, "pid": os.getpid()}

    return CheckWorker


def main() -> int:
    started = time.monotonic()
    import psutil
    import ray
    import torch
    from tensordict import TensorDict
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import reduce_metrics

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": repo, "OMP_NUM_THREADS": "1"}})
    failures: list[str] = []
    try:
        pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
        group = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ray.remote(make_worker_class())), device_name="cpu")
        out = group.train_batch(TensorDict({"x": torch.arange(8)}, batch_size=[8]))  # 4 rows per DP rank
        kept = tu.get(out, "metrics")  # data[0]: rank 0's output, as the trainer keeps it
        per_rank = {k: list(v) if isinstance(v, list) else v for k, v in kept.items()}
        reduced = reduce_metrics(kept)  # in place
        facts = group.facts()
        unpatched = group.unpatched()
    finally:
        ray.shutdown()
    rss = [f["rss"] / 2**30 for f in facts]
    worst = max(range(2), key=lambda r: rss[r])
    node_used = psutil.virtual_memory().used / 2**30

    def check(ok: bool, what: str) -> None:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            failures.append(what)

    print("verl check: verl 0.9.1 TrainingWorker._postprocess_output + rankmem, 2 ranks of verl's RayWorkerGroup, gloo")
    for note in facts[0]["notes"]:
        print(f"  {note}")
    print(f"  ranks' RSS (psutil, after the step): {', '.join(f'{v:.3f}' for v in rss)} GiB; node used {node_used:.2f} GiB")
    print(f"  kept (data[0]), gathered from every rank: mem/host/rss_gib/max {per_rank['mem/host/rss_gib/max']}")
    tol = 32 / 1024
    check(worst == 1, f"rank 1 (holding {BALLAST_MIB} MiB more) is the worst rank by RSS")
    check(abs(reduced["mem/host/rss_gib/max"] - rss[worst]) < tol,
          f"reduce_metrics: mem/host/rss_gib/max = {reduced['mem/host/rss_gib/max']:.3f} GiB, the worst rank's RSS")
    check(abs(reduced["mem/host/rss_gib/min"] - min(rss)) < tol,
          f"reduce_metrics: mem/host/rss_gib/min = {reduced['mem/host/rss_gib/min']:.3f} GiB, the best rank's RSS")
    check(abs(reduced["perf/cpu_memory_used_gb"] - sum(rss) / 2) < tol,
          f"perf/cpu_memory_used_gb = {reduced['perf/cpu_memory_used_gb']:.3f} GiB: process RSS, mean over ranks "
          f"(verl's rule for a name without max/min), not the node's used memory")
    check(reduced["actor/pg_loss"] == 3.5, f"actor/pg_loss reduced over both ranks' micro-batches: {reduced['actor/pg_loss']}")
    check("perf/max_memory_allocated_gb" not in reduced, "no device on CPU: no perf/max_memory_*_gb (absent, not 0)")
    print(f"  verl 0.9.1's method unchanged, rank 0's output (data[0]): {unpatched[0]} "
          "(the node's used memory; 0 for a device there is none of)")
    print(f"verl check: {'passed' if not failures else f'{len(failures)} failed'} in {time.monotonic() - started:.1f} s")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
