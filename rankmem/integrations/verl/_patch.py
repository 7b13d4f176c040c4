"""What :func:`rankmem.integrations.verl.setup` does to verl's engine worker module once a worker imports
it: the hand-written integration (docs/integrations.md) with no edit to verl. The engine's ``train_batch``
and ``infer_batch`` are the phases (not ``TrainingWorker``'s, which call ``_postprocess_output``: the
phase must close before the figures are taken). A module without the methods wrapped here, or with
other parameters: one warning and no patch."""

from __future__ import annotations

import functools
import inspect
import os
import sys
import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from rankmem.core.guard import Guard
from rankmem.integrations.verl._gather import VERL_NAMES, metrics_for_gather, tell_micro_batches
from rankmem.monitor import Monitor

PATCHED = "__rankmem_patched__"  # on each wrapper and the patched module: a second apply changes nothing

_SHAPE: dict[str, dict[str, tuple[str, ...]]] = {  # method -> its first parameters after self
    "TrainingWorker": {"reset": (), "_postprocess_output": (
        "output", "global_token_num", "delta_time", "forward_only", "images_seqlens")},
    "ActorRolloutRefWorker": {"update_weights": ("global_steps", "mode")},
}
_CARRY = "rankmem/carry/"  # verl's perf/* keys ride the gather under it: verl sets its own names after

_guard = Guard()
_state: dict[str, Any] = {"monitor": None, "collect": False, "every": 1, "calls": 0}


def settings(env: Any = os.environ) -> dict[str, Any]:
    """The Monitor's options from the runtime env (docs/integrations.md); a run directory per worker group."""
    out = env.get("RANKMEM_OUT") or env.get("RANKMEM_DIR") or None
    if out is not None and env.get("WG_PREFIX"):
        out = os.path.join(out, env["WG_PREFIX"])
    sinks: Any = [s.strip() for s in env.get("RANKMEM_SINKS", "").split(",") if s.strip()] or None
    every = env.get("RANKMEM_EVERY", "1")
    if not every.isdigit() or int(every) < 1:
        raise ValueError(f"RANKMEM_EVERY must be a whole number >= 1, got {every!r}")
    sinks = sinks if sinks is not None or out is not None else ()  # no directory, no sink: verl's trackers
    return {"out_dir": out, "sinks": sinks, "every": int(every)}


def apply(module: Any) -> None:
    if getattr(module, PATCHED, False):
        return
    missing = _mismatches(module)
    if missing:
        version = getattr(sys.modules.get("verl"), "__version__", "?")
        warnings.warn(f"rankmem: verl {version}'s engine worker is not one rankmem can patch (verl 0.9): "
                      f"{'; '.join(missing)}. This worker runs without rankmem; docs/integrations.md "
                      "shows the hand-written integration", RuntimeWarning, stacklevel=2)
        return
    _wrap(module.TrainingWorker, "reset", _after_reset)  # verl builds the engine's model there
    _wrap(module.TrainingWorker, "_postprocess_output", functools.partial(_postprocess_output, module.tu))
    _wrap(module.ActorRolloutRefWorker, "update_weights", _in_phase("weight_sync"))
    setattr(module, PATCHED, True)


def _mismatches(module: Any) -> list[str]:
    found = []
    for cls_name, methods in _SHAPE.items():
        for name, params in methods.items():
            fn = getattr(getattr(module, cls_name, None), name, None)
            if not callable(fn):
                found.append(f"no {cls_name}.{name}")
            elif tuple(inspect.signature(fn).parameters)[1:len(params) + 1] != params:
                found.append(f"{cls_name}.{name}{inspect.signature(fn)}")
            elif name == "update_weights" and not inspect.iscoroutinefunction(fn):
                found.append(f"{cls_name}.{name} is not async")
    tu_get = getattr(getattr(module, "tu", None), "get", None)
    return found if callable(tu_get) else [*found, "no verl.utils.tu"]


def _wrap(owner: Any, name: str, make: Any) -> None:
    # A class's method, or an instance's bound method; wraps() keeps verl's @register marks.
    wrapper = functools.wraps(getattr(owner, name))(make(getattr(owner, name)))
    setattr(wrapper, PATCHED, True)
    setattr(owner, name, wrapper)


def _after_reset(original: Any) -> Any:
    def reset(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        with _guard.contain("verl", "rankmem's start in verl's TrainingWorker.reset failed"):
            _start(self)
        return result
    return reset


def _phase(name: str) -> AbstractContextManager[None]:
    monitor = _state["monitor"]
    return nullcontext() if monitor is None else monitor.phase(name)


def _in_phase(name: str) -> Any:
    def make(original: Any) -> Any:
        async def coroutine(*args: Any, **kwargs: Any) -> Any:
            with _phase(name):
                return await original(*args, **kwargs)

        def method(*args: Any, **kwargs: Any) -> Any:
            with _phase(name):
                return original(*args, **kwargs)
        return coroutine if inspect.iscoroutinefunction(original) else method
    return make


def _start(worker: Any) -> None:
    engine = worker.engine
    for method, phase in (("train_batch", "update"), ("infer_batch", "log_prob")):
        if callable(getattr(engine, method, None)) and not getattr(getattr(engine, method), PATCHED, False):
            _wrap(engine, method, _in_phase(phase))  # on the instance: verl has many engine classes
    _tell_splits(type(engine).__module__)
    if _state["monitor"] is None:  # the actor's worker; the reference's shares its Monitor
        _state["monitor"] = _monitor(engine)
    monitor, optimizer = _state["monitor"], getattr(engine, "optimizer", None)
    if hasattr(monitor, "track") and optimizer is not None:  # the peak's anatomy, where the Monitor has it
        monitor.track(engine.module, optimizer)


def _monitor(engine: Any) -> Monitor:
    options = settings()
    _state["every"] = options.pop("every")
    group = None
    if options["out_dir"] is not None or options["sinks"]:  # collect over the ranks that produce outputs
        import torch.distributed as dist

        group = engine.get_data_parallel_group()
        if group is None and dist.is_initialized() and dist.get_world_size() > 1:  # 1 rank would collect
            raise ValueError("RANKMEM_OUT / RANKMEM_SINKS need data parallelism > 1 (unset, verl gets them)")
        _state["collect"] = True
    return Monitor(group=group, **options)


def _tell_splits(engine_module: str) -> None:
    # verl's prepare_micro_batches, in each loaded engine module that holds it, tells the open phase.
    split = getattr(sys.modules.get("verl.workers.engine.utils"), "prepare_micro_batches", None)
    for name in [n for n in sys.modules if n.startswith("verl.workers.engine.")] + [engine_module]:
        module: Any = sys.modules.get(name)
        if split is not None and getattr(module, "prepare_micro_batches", None) is split:
            module.prepare_micro_batches = _telling(split)


def _telling(split: Any) -> Any:
    @functools.wraps(split)
    def prepare_micro_batches(*args: Any, **kwargs: Any) -> Any:
        micro_batches, indices = split(*args, **kwargs)
        if _state["monitor"] is not None:
            with _guard.contain("verl-split", "telling verl's micro-batches failed"):
                tell_micro_batches(_state["monitor"], micro_batches)
        return micro_batches, indices
    return prepare_micro_batches


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
            for key in VERL_NAMES:  # rank-local after the gather in verl: ours, or none (no device)
                carried = gathered.pop(_CARRY + key, None)
                gathered.pop(key, None)
                if carried is not None:
                    gathered[key] = carried
        return final
    return method
