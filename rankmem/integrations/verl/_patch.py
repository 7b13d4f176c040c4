"""The patch :func:`rankmem.integrations.verl.setup` applies to verl's engine worker module when a worker
imports it: what the hand-written integration (docs/integrations.md) adds to verl, with no edit to verl.

On verl's ``TrainingWorker`` (each rank of the actor, reference and critic):

- ``__init__``: one Monitor per process (actor and reference share it), built from the runtime env
  (:func:`settings`); and verl's micro-batch split (``prepare_micro_batches``, in the module of each
  engine verl has loaded) wrapped so that each micro-batch's work is told to the open phase.
- ``reset`` (the engine builds the model and optimizer there): ``monitor.track(model, optimizer)``
  where the Monitor has ``track`` and the engine an optimizer (the peak's anatomy).
- its engine's ``train_batch`` is the phase ``update`` (one mini-batch), ``infer_batch`` the phase
  ``log_prob``: the engine's calls, so that each phase has closed when its figures are taken.
- ``_postprocess_output``: this rank's figures go into the metrics dict *before* verl's data-parallel
  gather (:func:`~rankmem.integrations.verl.metrics_for_gather`, or with a run directory the
  collect's aggregates), so the driver's ``reduce_metrics`` shows the worst rank; verl's three
  ``perf/*`` memory keys, which it sets after the gather from this rank alone (and the node's used
  memory), carry rankmem's gathered figures instead, or are left out where there is none (no device).

On ``ActorRolloutRefWorker``: ``update_weights`` (the weight sync to the rollout, with its wake of the
engine's weights and KV cache) is the phase ``weight_sync``. verl 0.9 runs the rollout itself, and its
sleep, in the vLLM / SGLang server actors, which are other processes.

A verl whose engine worker lacks any of these, or has them with another signature, is not patched:
one warning in that worker, which then runs as verl wrote it.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import warnings
from typing import Any

from rankmem.core.guard import Guard
from rankmem.integrations.verl._gather import VERL_NAMES, metrics_for_gather, tell_micro_batches
from rankmem.monitor import Monitor

PATCHED = "__rankmem_patched__"
"""Set on each method the patch wraps (and on the module): a second apply changes nothing."""

# What the patch relies on: method -> the parameters (after self) it passes through or reads.
_SHAPE: dict[str, dict[str, tuple[str, ...]]] = {
    "TrainingWorker": {"__init__": ("config",), "reset": (), "_postprocess_output": ("output", "global_token_num", "delta_time", "forward_only",
                                               "images_seqlens")},
    "ActorRolloutRefWorker": {"update_weights": ("global_steps", "mode")},
}
_CARRY = "rankmem/carry/"
"""Prefix under which verl's own ``perf/*`` keys ride the gather (verl overwrites them after it)."""

_guard = Guard()
_state: dict[str, Any] = {"monitor": None, "collect": False, "every": 1, "calls": 0}


def settings(env: Any = os.environ) -> dict[str, Any]:
    """The Monitor's options from the runtime env: ``RANKMEM_OUT`` (or ``RANKMEM_DIR``), a directory all
    workers reach, the run log of each verl worker group going to ``<it>/<WG_PREFIX>``; ``RANKMEM_SINKS``,
    sink names with commas (default: the run log where there is a directory, else none: the figures
    then reach verl's own trackers only); ``RANKMEM_EVERY``, figures every N-th output (default 1)."""
    out = env.get("RANKMEM_OUT") or env.get("RANKMEM_DIR") or None
    if out is not None and env.get("WG_PREFIX"):
        out = os.path.join(out, env["WG_PREFIX"])
    sinks = [s.strip() for s in env.get("RANKMEM_SINKS", "").split(",") if s.strip()] or None
    every = env.get("RANKMEM_EVERY", "1")
    if not every.isdigit() or int(every) < 1:
        raise ValueError(f"RANKMEM_EVERY must be a whole number >= 1, got {every!r}")
    return {"out_dir": out, "sinks": sinks if sinks is not None or out is not None else (), "every": int(every)}


def apply(module: Any) -> None:
    if getattr(module, PATCHED, False):
        return
    missing = _mismatches(module)
    if missing:
        version = getattr(sys.modules.get("verl"), "__version__", "?")
        warnings.warn(f"rankmem: verl {version}'s engine worker is not the one rankmem knows how to patch "
                      f"(verl 0.9.x): {'; '.join(missing)}. This worker runs without rankmem; the hand-written "
                      "integration in docs/integrations.md still works", RuntimeWarning, stacklevel=2)
        return
    tw, arw = module.TrainingWorker, module.ActorRolloutRefWorker
    _wrap(tw, "__init__", _after(_start))
    _wrap(tw, "reset", _after(_track))
    _wrap(tw, "_postprocess_output", functools.partial(_postprocess_output, module.tu))
    _wrap(arw, "update_weights", _in_phase("weight_sync", awaited=True))
    setattr(module, PATCHED, True)


def _mismatches(module: Any) -> list[str]:
    found = []
    for cls_name, methods in _SHAPE.items():
        cls = getattr(module, cls_name, None)
        for name, params in methods.items():
            fn = getattr(cls, name, None)
            if not callable(fn):
                found.append(f"no {cls_name}.{name}")
            elif tuple(inspect.signature(fn).parameters)[1:len(params) + 1] != params:
                found.append(f"{cls_name}.{name}{inspect.signature(fn)}")
            elif name == "update_weights" and not inspect.iscoroutinefunction(fn):
                found.append(f"{cls_name}.{name} is not async")
    if not callable(getattr(getattr(module, "tu", None), "get", None)):
        found.append("no tensordict_utils as tu")
    return found


def _wrap(cls: type, name: str, make: Any) -> None:
    original = cls.__dict__[name]
    wrapper = functools.wraps(original)(make(original))  # keeps verl's @register marks
    setattr(wrapper, PATCHED, True)
    setattr(cls, name, wrapper)


def _wrap_bound(engine: Any, name: str, make: Any) -> None:
    wrapper = functools.wraps(getattr(engine, name))(make(getattr(engine, name)))
    setattr(wrapper, PATCHED, True)
    setattr(engine, name, wrapper)  # on the instance: the engine classes are verl's many backends


def _after(then: Any) -> Any:
    def make(original: Any) -> Any:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            with _guard.contain("verl", "rankmem's verl patch failed after a verl call"):
                then(self)
            return result
        return method
    return make


def _in_phase(name: str, awaited: bool = False) -> Any:
    def make(original: Any) -> Any:  # a method, or a bound method
        def method(*args: Any, **kwargs: Any) -> Any:
            monitor = _state["monitor"]
            if monitor is None:
                return original(*args, **kwargs)
            with monitor.phase(name):
                return original(*args, **kwargs)

        async def coroutine(*args: Any, **kwargs: Any) -> Any:
            monitor = _state["monitor"]
            if monitor is None:
                return await original(*args, **kwargs)
            with monitor.phase(name):
                return await original(*args, **kwargs)
        return coroutine if awaited else method
    return make


def _start(worker: Any) -> None:
    """The process's Monitor, on the first TrainingWorker built; this worker's engine calls as phases, and
    each loaded engine's split told."""
    engine = worker.engine
    for method, phase in (("train_batch", "update"), ("infer_batch", "log_prob")):
        if callable(getattr(engine, method, None)) and not getattr(getattr(engine, method), PATCHED, False):
            _wrap_bound(engine, method, _in_phase(phase))
    _tell_splits(type(engine).__module__)
    if _state["monitor"] is not None:
        return
    options = settings()
    _state["every"] = options.pop("every")
    group = None
    if options["out_dir"] is not None or options["sinks"]:  # a run log: collect over the ranks that produce outputs (one per DP rank)
        import torch.distributed as dist

        group = worker.engine.get_data_parallel_group()
        if group is None and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("RANKMEM_OUT / RANKMEM_SINKS need data parallelism > 1 here (verl gives no "
                             "data-parallel group): unset them, the figures still reach verl's trackers")
        _state["collect"] = True
    _state["monitor"] = Monitor(group=group, **options)


def _tell_splits(engine_module: str) -> None:
    utils = sys.modules.get("verl.workers.engine.utils")
    split = getattr(utils, "prepare_micro_batches", None)
    if split is None:
        return
    names = [n for n in sys.modules if n.startswith("verl.workers.engine.")] + [engine_module]
    for name in names:
        module: Any = sys.modules.get(name)
        if getattr(module, "prepare_micro_batches", None) is split:
            module.prepare_micro_batches = _telling(split)


def _telling(split: Any) -> Any:
    @functools.wraps(split)
    def prepare_micro_batches(*args: Any, **kwargs: Any) -> Any:
        micro_batches, indices = split(*args, **kwargs)
        monitor = _state["monitor"]
        if monitor is not None:
            with _guard.contain("verl-split", "telling verl's micro-batches failed"):
                tell_micro_batches(monitor, micro_batches)
        return micro_batches, indices
    return prepare_micro_batches


def _track(worker: Any) -> None:
    monitor, engine = _state["monitor"], worker.engine
    optimizer = getattr(engine, "optimizer", None)
    if monitor is not None and hasattr(monitor, "track") and optimizer is not None:
        monitor.track(engine.module, optimizer)


def _postprocess_output(tu: Any, original: Any) -> Any:
    def method(self: Any, output: Any, **kwargs: Any) -> Any:
        monitor, metrics = _state["monitor"], output.get("metrics") if isinstance(output, dict) else None
        if monitor is None or not isinstance(metrics, dict):
            return original(self, output, **kwargs)
        with _guard.contain("verl-figures", "rankmem's figures for verl's metrics failed"):
            _state["calls"] += 1
            if _state["calls"] % _state["every"] == 0:
                ours = ({k: [v] for k, v in monitor.collect().items()} if _state["collect"]
                        else metrics_for_gather(monitor))
                metrics.update({(_CARRY + k if k in VERL_NAMES else k): v for k, v in ours.items()})
        final = original(self, output, **kwargs)
        with _guard.contain("verl-figures", "rankmem's figures for verl's metrics failed"):
            gathered = tu.get(final, "metrics")
            for key in VERL_NAMES:
                carried = gathered.pop(_CARRY + key, None)
                gathered.pop(key, None)
                if carried is not None:
                    gathered[key] = carried
        return final
    return method
