"""Process-group helpers: who this rank is, and the small collectives every other exchange module builds on.

Each function is a collective over ``group`` where it communicates: every rank calls it, on the same steps,
in the same order. With no initialised process group (or a world of one) none of them communicates.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from rankmem.errors import RankmemError


def _initialised() -> Any:
    """torch.distributed when a process group is initialised, else None. A group exists only where its
    module is loaded: the question imports nothing (torch takes a second or more), and a module still
    being imported on another thread (the run log's header asks torch's version) has no group yet."""
    dist = sys.modules.get("torch.distributed")
    try:
        return dist if dist is not None and dist.is_available() and dist.is_initialized() else None
    except AttributeError:  # part-imported
        return None


def dist_active(group: Any = None) -> bool:
    """True when torch.distributed is initialised and the group has more than one rank."""
    dist = _initialised()
    return dist is not None and bool(dist.get_world_size(group) > 1)


def rank_and_world(group: Any = None) -> tuple[int, int]:
    dist = _initialised()
    return (0, 1) if dist is None else (int(dist.get_rank(group)), int(dist.get_world_size(group)))


def launcher_world() -> int | None:
    """The world size the launcher announced (``WORLD_SIZE``: torchrun, Ray Train and rankmem's Ray
    launcher all set it), when it says several ranks and no process group is initialised; else None."""
    raw = os.environ.get("WORLD_SIZE", "")
    if not raw.strip().isdigit() or int(raw) < 2 or _initialised() is not None:
        return None
    return int(raw)


def require_group_if_launched(group: Any) -> None:
    """Several ranks launched and no process group: every process would call itself rank 0 of 1, one run
    log would win and the report would say ``1 ranks``, exit 0. Refused where it can be fixed: before
    anything is measured."""
    world = launcher_world() if group is None else None
    if world is not None:
        raise RankmemError(
            f"WORLD_SIZE={world} says this job has {world} ranks, but no process group is initialised: call "
            "torch.distributed.init_process_group() before building the Monitor (on every rank), or it would "
            "measure each process as a world of one (to measure this process alone, unset WORLD_SIZE)")


def global_rank() -> int:
    """This process's rank in the world (``RANK`` before the process group exists), for per-rank files."""
    rank, _ = rank_and_world(None)
    if rank == 0 and not dist_active(None):
        return int(os.environ.get("RANK", "0") or 0)
    return rank


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Pickled gather: two collectives and a pickle per rank. Only for rare, one-off exchanges."""
    if not dist_active(group):
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _check_local_device(device: str, index: int, count: int) -> str | None:
    """A warning when a device collective would run on a device that is not ``LOCAL_RANK``'s.

    NCCL ranks that gather on the same GPU fail or hang (ranks that never called ``set_device`` all sit on
    device 0). ``index`` is the device the gather uses; with one visible device per rank every rank is on
    device 0 by design, and nothing is said.
    """
    local = os.environ.get("LOCAL_RANK")
    if local is None or count < 2 or not local.isdigit() or index == int(local) % count:
        return None
    return (
        f"LOCAL_RANK={local} but this rank gathers on {device}:{index}, its current device: call "
        f"torch.{device}.set_device(local_rank) before the first collect(), or the gathers may fail or hang"
    )


def _all_gather_single(out: Any, inp: Any, group: Any) -> None:
    """One tensor all-gather into a flat output (``all_gather_into_tensor``, renamed in torch 2.13)."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "")
    try:
        return int(text) if text else default
    except ValueError:
        raise RankmemError(f"{name}={text!r}: expected an integer") from None


REDUCE_ABOVE = 128
"""Default crossover world size: above it the aggregates travel by all-reduce (bench/RESULTS.md, "Scale")."""
DETAIL_EVERY = 100
"""Default cadence of the per-rank detail on the all-reduce path, in collects."""


def reduce_above_default() -> int:
    """:data:`REDUCE_ABOVE`, or ``$RANKMEM_REDUCE_ABOVE`` (``MonitorConfig.reduce_above``'s default)."""
    return _env_int("RANKMEM_REDUCE_ABOVE", REDUCE_ABOVE)


def detail_every_default() -> int:
    """:data:`DETAIL_EVERY`, or ``$RANKMEM_DETAIL_EVERY`` (``MonitorConfig.detail_every``'s default)."""
    return _env_int("RANKMEM_DETAIL_EVERY", DETAIL_EVERY)
