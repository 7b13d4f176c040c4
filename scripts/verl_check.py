"""verl 0.9.1's own launcher and ``TrainingWorker`` flow, run twice: once with the README's diff to verl's
source, once with rankmem's setup hook and no source edit. The driver must see the same figures.

Run in the environment ``make verl-check`` builds (verl 0.9.1 with all its dependencies, which the
test environment cannot hold: verl pins transformers < 5.11)::

    make verl-check        # or: .venv-verl/bin/python scripts/verl_check.py

verl's code here: Hydra composing verl's ``ppo_trainer`` config with the command-line overrides;
``main_ppo.run_ppo`` (``ray.init`` with the config's runtime env, then the TaskRunner actor);
``RayResourcePool``/``RayWorkerGroup`` (the worker actors, with per-actor ``env_vars``); and, in each of
the 2 ranks, ``TrainingWorker`` itself: ``__init__``, ``reset``, ``train_mini_batch`` (verl's mini-batch
iterator), ``train_batch``, ``_postprocess_output`` (the data-parallel gather), with the dispatch that
hands the driver ``data[0]``, verl's micro-batch split ``prepare_micro_batches`` and ``reduce_metrics``.

Not verl's, for want of a GPU: the engine. verl 0.9.1 registers engines for cuda and npu only, so a
stand-in (``CheckEngine``) is registered under verl's ``EngineRegistry``. Its ``train_batch`` splits the
mini-batch with ``prepare_micro_batches`` looked up in verl's FSDP engine module, as
``FSDPEngine.forward_backward_batch`` does, and "runs" each micro-batch as an allocation of
``BYTES_PER_TOKEN`` per token on a fake device (``rankmem.testing.FakeCuda`` in place of ``torch.cuda``,
from before verl's worker is built). verl's default process group asks a CPU-only torch for NCCL, so
each rank joins a gloo group first (verl's own call then finds it made); the worker's ``device_name`` is
``cpu``. Rank 1 holds 256 MiB more than rank 0 and runs longer sequences: the worst rank to find.

The README's diff (docs/integrations.md) is applied to the installed verl's source of
``train_batch`` and ``_postprocess_output`` (compiled in the module's own namespace), plus its two
lines in ``__init__`` and its engine line. The hook route changes nothing: the Hydra token puts
``rankmem.integrations.verl.setup`` in ``ray.init``'s runtime env and Ray runs it in every worker.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import sys
import tempfile
import textwrap
import time
import types
from contextlib import nullcontext
from typing import Any

import ray

TOKEN = "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=rankmem.integrations.verl.setup"
BALLAST_MIB = 256
BYTES_PER_TOKEN = 1 << 20  # the fake device's activations: 1 MiB per token of a micro-batch
SEQ_LENS = {0: [4, 9, 6, 11, 5, 8, 7, 10], 1: [24, 31, 20, 27, 29, 22, 30, 25]}  # per DP rank, step 1
STEPS = 2  # step 2's sequences are half as long: a lifetime peak would still say step 1's
# The README's diff: (line in verl's source, what replaces it); None deletes the line.
DIFF = {
    "_postprocess_output": {
        'metrics: dict = output.pop("metrics")': ['metrics: dict = output.pop("metrics")',
                                                 "metrics.update(metrics_for_gather(self.rankmem))"],
        'final_metrics["perf/max_memory_allocated_gb"] = get_torch_device().max_memory_allocated() / (1024**3)': None,
        'final_metrics["perf/max_memory_reserved_gb"] = get_torch_device().max_memory_reserved() / (1024**3)': None,
        'final_metrics["perf/cpu_memory_used_gb"] = psutil.virtual_memory().used / (1024**3)': None,
    },
    "train_batch": {
        "output = self.engine.train_batch(data, loss_function=self.loss_fn)": [
            'with self.rankmem.phase("update"):',
                                                                               "    output = "
                                                                               "self.engine.train_batch(data, "
                                                                               "loss_function=self.loss_fn)"],
    },
}


def with_diff(method: str) -> Any:
    """verl's installed ``TrainingWorker.<method>`` with the README's diff applied (each line found once)."""
    import verl.workers.engine_workers as ew

    from rankmem.integrations.verl import metrics_for_gather

    path = inspect.getsourcefile(ew)
    assert path is not None
    text = open(path).read()
    [cls] = [n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "TrainingWorker"]
    [fn] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method]
    assert fn.end_lineno is not None
    lines = text.splitlines()[fn.lineno - 1: fn.end_lineno]  # from its def: verl's decorators left out
    for old, new in DIFF[method].items():
        at = [i for i, line in enumerate(lines) if line.strip() == old]
        assert len(at) == 1, f"verl changed: {old!r} not found once in {path}"
        indent = lines[at[0]][: len(lines[at[0]]) - len(lines[at[0]].lstrip())]
        lines[at[0]: at[0] + 1] = [indent + line for line in new or []]
    namespace = dict(vars(ew), metrics_for_gather=metrics_for_gather)
    exec(compile(textwrap.dedent("\n".join(lines)), path, "exec"), namespace)
    return namespace[method]


def make_classes() -> tuple[type, type]:
    import psutil
    import torch
    import torch.distributed as dist
    from verl.single_controller.base.decorator import (
        Dispatch,
        make_nd_compute_dataproto_dispatch_fn,
        register,
    )
    from verl.utils.distributed import initialize_global_process_group_ray
    from verl.workers.engine.base import BaseEngine
    from verl.workers.engine_workers import TrainingWorker

    from rankmem.testing import FakeCuda

    class Cfg(types.SimpleNamespace):
        def get(self, key: str, default: Any = None) -> Any:
            return getattr(self, key, default)

    class CheckEngine(BaseEngine):  # type: ignore[misc]
        """The stand-in engine: data parallel over the whole world, micro-batches as device allocations."""

        def __init__(self, **configs: Any) -> None:
            self.seen: list[list[int]] = []  # per train_batch call, each micro-batch's tokens

        def initialize(self) -> None:
            self.module = torch.nn.Linear(64, 64)
            self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)

        def train_mode(self, **kwargs: Any) -> Any:
            return nullcontext()

        def get_data_parallel_group(self) -> Any:
            return dist.group.WORLD

        def get_data_parallel_size(self) -> int:
            return dist.get_world_size()

        def get_data_parallel_rank(self) -> int:
            return dist.get_rank()

        def is_mp_src_rank_with_outputs(self) -> bool:
            return True

        def lr_scheduler_step(self) -> float:
            return 0.1

        def train_batch(self, data: Any, loss_function: Any) -> dict[str, Any]:
            from verl.workers.engine.fsdp import transformer_impl as fsdp_engine

            micro_batches, _ = fsdp_engine.prepare_micro_batches(
                data=data, dp_group=self.get_data_parallel_group(), same_micro_num_in_dp=True)
            if getattr(self, "rankmem", None) is not None:  # the README's line in the engine
                from rankmem.integrations.verl import tell_micro_batches

                tell_micro_batches(self.rankmem, micro_batches)
            self.seen.append([])
            for micro_batch in micro_batches:
                tokens = int(micro_batch["attention_mask"].sum())
                torch.cuda.free(torch.cuda.malloc(tokens * BYTES_PER_TOKEN))  # the FakeCuda put in below
                self.seen[-1].append(tokens)
            return {"loss": [0.25 * len(micro_batches)], "metrics": {"actor/pg_loss": [float(dist.get_rank())]},
                    "model_output": {}}

    class CheckWorker(TrainingWorker):  # type: ignore[misc]
        def __init__(self, route: str) -> None:
            from verl.workers.engine.base import EngineRegistry

            torch.cuda = FakeCuda()  # type: ignore[assignment]  # before any Monitor looks for a device
            torch.cuda.synchronize = lambda device=None: None  # tensordict's .cpu() waits for the device
            initialize_global_process_group_ray(timeout_second=120, backend="gloo")  # verl's default asks for NCCL
            if "rankmem_check" not in EngineRegistry._engines.get("language_model", {}):
                EngineRegistry.register("language_model", "rankmem_check", device=["cuda", "cpu"])(CheckEngine)
            engine = Cfg(strategy="rankmem_check", forward_only=False, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=2,
                         max_token_len_per_gpu=None, infer_max_token_len_per_gpu=None, infer_micro_batch_size_per_gpu=2)
            super().__init__(Cfg(model_type="language_model", model_config=Cfg(), engine_config=engine,
                                 optimizer_config=Cfg(), checkpoint_config=Cfg(), profiler_config=None))
            self.device_name = "cpu"  # verl's get_device_name() says cuda on a machine with no accelerator
            if route == "diff":
                from rankmem import Monitor

                self.rankmem = Monitor(sinks=())  # the README's two lines in TrainingWorker.__init__
                self.engine.rankmem = self.rankmem
                self.train_batch = types.MethodType(with_diff("train_batch"), self)
                self._postprocess_output = types.MethodType(with_diff("_postprocess_output"), self)
            self.reset()  # as ActorRolloutRefWorker.init_model does: the engine builds its model
            self.set_loss_fn(lambda *args, **kwargs: None)
            self.ballast = bytearray(BALLAST_MIB << 20) if self.rank == 1 else None  # zero-filled: resident

        @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"))
        def update(self, data: Any) -> Any:
            """ActorRolloutRefWorker.update_actor's body."""
            output = self.train_mini_batch(data=data)
            return output.cpu() if output is not None else None

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def facts(self) -> dict[str, Any]:
            import verl.workers.engine_workers as ew

            return {"rss": psutil.Process().memory_info().rss, "seen": self.engine.seen, "rank": self.rank,
                     "patched": getattr(ew.TrainingWorker._postprocess_output, "__rankmem_patched__", False),
                     "env": {k: os.environ.get(k, "") for k in ("RANK", "WORLD_SIZE", "WG_PREFIX")}}

    return CheckWorker, CheckEngine


@ray.remote(num_cpus=0)
class CheckRunner:
    """verl's TaskRunner's part: builds the worker group and drives the update, as ``RayPPOTrainer`` does."""

    def run(self, config: Any) -> None:
        import torch
        from tensordict import TensorDict
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from verl.utils import tensordict_utils as tu
        from verl.utils.metric import reduce_metrics

        result: dict[str, Any] = {"runner": {"hook": any(type(f).__name__ == "_Finder" for f in sys.meta_path),
                                             "rankmem_monitor_loaded": "rankmem.monitor" in sys.modules}}
        worker_cls, _ = make_classes()
        pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
        group = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ray.remote(worker_cls), route=os.environ["CHECK_ROUTE"]),
                               device_name="cpu")
        result["steps"] = []
        for step in range(STEPS):
            mask = torch.zeros(16, 32, dtype=torch.long)
            for row, n in enumerate(SEQ_LENS[0] + SEQ_LENS[1]):  # rows 0-7 go to DP rank 0, 8-15 to rank 1
                mask[row, : n >> step] = 1
            data = TensorDict({"attention_mask": mask}, batch_size=[16])
            tu.assign_non_tensor(data, num_mini_batch=2, epochs=1, seed=42)
            metrics = tu.get(group.update(data), "metrics")  # data[0], as the trainer keeps it
            lists = {k: list(v) for k, v in metrics.items() if isinstance(v, list)}  # mini-batch by DP rank
            result["steps"].append({"lists": lists, "reduced": reduce_metrics(metrics)})
        result["ranks"] = group.facts()
        with open(os.environ["CHECK_RESULT"], "w") as f:
            json.dump(result, f, default=float)


def run_route(route: str, *settings: str) -> dict[str, Any]:
    """verl's ``run_ppo`` on its composed ``ppo_trainer`` config, with the token for the hook route."""
    from hydra import compose, initialize_config_dir
    from verl.trainer import main_ppo

    overrides = ["ray_kwargs.ray_init.num_cpus=4", "+ray_kwargs.ray_init.include_dashboard=false",
                 "+ray_kwargs.ray_init.logging_level=ERROR", *settings] + ([TOKEN] if route == "hook" else [])
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(main_ppo.__file__), "config"),
                               version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        os.environ.update(CHECK_ROUTE=route, CHECK_RESULT=out.name)  # the local cluster's workers inherit these
        try:
            main_ppo.run_ppo(config, CheckRunner)
            runtime_env = ray.get_runtime_context().runtime_env
        finally:
            ray.shutdown()
        result = json.load(open(out.name))
    result["runtime_env_hook"] = runtime_env.get("worker_process_setup_hook")
    return result


def main() -> int:
    started = time.monotonic()
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            failures.append(what)

    diff, hook = run_route("diff"), run_route("hook")
    print("verl check: verl 0.9.1's run_ppo and TrainingWorker on 2 ranks (gloo), the README's diff vs the hook")
    check(diff["runtime_env_hook"] is None and hook["runtime_env_hook"] == "rankmem.integrations.verl.setup",
          f"the Hydra token puts the hook in ray.init's runtime env: {hook['runtime_env_hook']}")
    check(hook["runner"] == {"hook": True, "rankmem_monitor_loaded": False},
          f"the TaskRunner ran the hook and loaded no more of rankmem: {hook['runner']}")
    check([r["patched"] for r in hook["ranks"]] == [True,
                                                    True] and [r["patched"] for r in diff["ranks"]] == [False] * 2,
          "each worker RayWorkerGroup made (per-actor env_vars "
          f"{hook['ranks'][1]['env']}) has the patch with the hook, not without")
    for n in range(STEPS):
        ranks = hook["ranks"]
        seen = [[max(mb) for mb in r["seen"][n * 2: n * 2 + 2]] for r in ranks]  # per rank, per mini-batch
        heaviest = max(max(s) for s in seen)
        peaks = [seen[r][mb] * BYTES_PER_TOKEN / 2**30 for mb in range(2) for r in range(2)]  # verl's list order
        d, h = diff["steps"][n], hook["steps"][n]
        print(f"  step {n + 1}: heaviest micro-batch per rank and mini-batch {seen}")
        # The hook also tracks the actor's model and optimizer (the README diff does not): its anatomy keys.
        hook_keys = {k for k in h["reduced"] if k.startswith(("mem/", "perf/")) and "/anatomy/" not in k}
        check(hook_keys == {k for k in d["reduced"] if k.startswith(("mem/", "perf/"))}
              and any("/anatomy/" in k for k in h["reduced"]),
              "the same keys reach the driver, and the hook's anatomy besides")
        for key in ("perf/max_memory_allocated_gb", "mem/device/peak_allocated_gib/max"):
            check(d["lists"][key] == h["lists"][key] == peaks,
                  f"{key} per mini-batch and rank: each window's own peak {h['lists'][key]}")
        tokens = "mem/phase/update/heaviest_mb_tokens/max"
        check(d["lists"][tokens] == h["lists"][tokens] == [seen[r][mb] for mb in range(2) for r in range(2)],
              f"{tokens} per mini-batch and rank: the engine's heaviest micro-batch {h['lists'][tokens]}")
        check(d["reduced"][tokens] == h["reduced"][tokens] == heaviest,
              f"reduce_metrics: {tokens} = {h['reduced'][tokens]}, the heaviest of the step ({heaviest})")
        rss = [r["rss"] / 2**30 for r in ranks]
        for key in ("mem/host/rss_gib/max", "perf/cpu_memory_used_gb"):
            check(abs(d["reduced"][key] - h["reduced"][key]) < 32 / 1024 and abs(h["reduced"][key] - rss[1]) < 32 / 1024
                  if key.endswith("max") else abs(h["reduced"][key] - sum(rss) / 2) < 32 / 1024,
                  f"{key}: {d['reduced'][key]:.3f} (diff) {h['reduced'][key]:.3f} (hook) GiB; "
                  f"ranks' RSS {rss[0]:.3f}, {rss[1]:.3f}")
    with tempfile.TemporaryDirectory() as runs:  # the README's line: a run log per worker group
        logged = run_route("hook", f'+ray_kwargs.ray_init.runtime_env.env_vars.RANKMEM_OUT="{runs}"')
        [prefix] = os.listdir(runs)
        lines = [json.loads(line) for line in open(os.path.join(runs, prefix, "rankmem.jsonl"))]
    worst = logged["steps"][-1]["reduced"]["mem/host/rss_gib/max_rank"]
    check(lines[0]["world_size"] == 2 and len(lines) == 1 + STEPS * 2 and worst == 1,
          f"with RANKMEM_OUT: {prefix}/rankmem.jsonl, {len(lines) - 1} records of world 2 (a collect per "
          f"mini-batch), and verl's metrics name the worst rank: mem/host/rss_gib/max_rank = {worst}")
    verdict = "passed" if not failures else f"{len(failures)} failed"
    print(f"verl check: {verdict} in {time.monotonic() - started:.1f} s")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
