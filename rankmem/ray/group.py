"""The driver's side of a Ray worker group: one actor per rank, called together, failures named by rank.

The shape of verl's ``RayWorkerGroup``: one placement group bundle per rank, each actor told its rank,
world size and local rank, rank 0's address and a free port as ``MASTER_ADDR``/``MASTER_PORT``.
:meth:`WorkerGroup.call` calls one method on every actor and gathers the results in rank order.
:meth:`WorkerGroup.gather` waits for whichever rank finishes first; when one fails, the others are
usually blocked in a collective, so after a short grace it raises :class:`RankFailed` naming the rank
that caused it. :meth:`WorkerGroup.shutdown` asks every actor to flush its telemetry, then kills them
and frees the placement group. ray is imported inside the methods.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rankmem.core.guard import attempt
from rankmem.errors import RankmemError

FAILURE_GRACE_S = 3.0
"""After a rank fails, how long to wait for the other ranks' outcomes before naming the culprit."""
SHUTDOWN_FLUSH_S = 5.0
"""At shutdown, how long the actors get to put their queued telemetry on disk before the kill."""


@dataclass(frozen=True)
class Resources:
    """What each rank's actor reserves."""

    num_cpus: float = 1.0
    """CPUs per actor; fractions share cores (``0.5``: two ranks per core)."""
    num_gpus: float = 0.0
    """GPUs per actor (Ray then narrows the actor's ``CUDA_VISIBLE_DEVICES`` to them)."""

    def __post_init__(self) -> None:
        if not self.num_cpus > 0 or not self.num_gpus >= 0:  # a bundle cannot be empty
            raise RankmemError(f"an actor needs CPU > 0 and GPU >= 0, got {self.num_cpus} CPU, {self.num_gpus} GPU")

    def bundle(self) -> dict[str, float]:
        return {k: v for k, v in (("CPU", self.num_cpus), ("GPU", self.num_gpus)) if v > 0}


@dataclass(frozen=True)
class Placement:
    """Where a rank's actor runs."""

    node_id: str
    local_rank: int
    local_world_size: int


class RankFailed(RuntimeError):
    """A rank's actor failed during :meth:`WorkerGroup.call`: its method raised (``died`` false) or the
    actor process died (``died`` true: killed, out of memory, crashed)."""

    def __init__(self, rank: int, died: bool, cause: BaseException, where: str = "", during: str = "") -> None:
        self.rank, self.died, self.cause = rank, died, cause
        root = getattr(cause, "cause", None)  # RayTaskError carries the actor's own exception
        detail = f"{type(root).__name__}: {root}" if not died and root is not None else _first_line(cause)
        super().__init__(f"rank {rank}{where} {'died' if died else 'failed'}{' ' + during if during else ''}: {detail}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def placements(bundles_to_node: dict[int, str]) -> list[Placement]:
    """Each bundle's node and its local rank there (bundle order among the bundles on the same node)."""
    per_node: dict[str, list[int]] = {}
    for bundle in sorted(bundles_to_node):
        per_node.setdefault(bundles_to_node[bundle], []).append(bundle)
    out = []
    for bundle in sorted(bundles_to_node):
        node = bundles_to_node[bundle]
        out.append(Placement(node, per_node[node].index(bundle), len(per_node[node])))
    return out


class WorkerGroup:
    """``world_size`` actors of ``actor_cls`` (a :class:`rankmem.ray.rank.RankActor`), one per rank.

    ``pack``: all ranks on one node (``STRICT_PACK``), else as few nodes as fit (``PACK``).
    ``ready_timeout_s``: how long the cluster gets to grant the placement group.
    """

    def __init__(self, actor_cls: type, world_size: int, resources: Resources, *, pack: bool = True,
                 ready_timeout_s: float = 60.0, name: str = "rankmem") -> None:
        import ray
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size = world_size
        self.actors: list[Any] = []
        self._flushes = callable(getattr(actor_cls, "flush_telemetry", None))
        self.where: list[str] = [""] * world_size  # " (pid P on HOST)" once known, for messages
        self.pg: Any = placement_group([resources.bundle() for _ in range(world_size)],
                                  strategy="STRICT_PACK" if pack else "PACK", name=f"{name}-ranks")
        try:
            ray.get(self.pg.ready(), timeout=ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            free = _short(ray.available_resources())  # type: ignore[no-untyped-call]
            raise RankmemError(f"the Ray cluster did not grant {world_size} actors of {resources.bundle()} "
                               f"{'on one node ' if pack else ''}within {ready_timeout_s:g} s: its free resources "
                               f"are {free}") from None
        self.placements = placements(placement_group_table(self.pg)["bundles_to_node_id"])
        remote: Any = ray.remote(actor_cls)
        for rank, where in enumerate(self.placements):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=rank)
            # max_restarts=0: a dead rank ends the job, as under torchrun --max-restarts 0.
            options = dict(num_cpus=resources.num_cpus, num_gpus=resources.num_gpus, max_restarts=0,
                           scheduling_strategy=strategy, name=f"{name}-rank{rank}")
            self.actors.append(remote.options(**options).remote(rank, world_size, where.local_rank,
                                                                where.local_world_size))

    def setup(self, device_choice: str, timeout_s: float) -> list[str]:
        """Locate every actor, then join them into one process group at rank 0's address. Returns each
        rank's device."""
        for info in self.call("whereami", timeout_s=timeout_s, during="while starting"):
            self.where[int(info["rank"])] = f" (pid {info['pid']} on {info['host']})"
        addr, port = self.call_rank(0, "rendezvous_address", timeout_s=timeout_s, during="while starting")
        devices: list[str] = self.call("join", addr, port, device_choice, timeout_s, timeout_s=timeout_s,
                                       during="while joining the process group")
        return devices

    def call(self, method: str, *args: Any, timeout_s: float | None = None, during: str = "") -> list[Any]:
        """``method(*args)`` on every rank at once; the results in rank order. Raises
        :class:`RankFailed` naming the failing rank (``during`` says when, for its message), and
        ``TimeoutError`` past ``timeout_s``."""
        return self.gather([getattr(actor, method).remote(*args) for actor in self.actors], timeout_s, during=during)

    def call_rank(self, rank: int, method: str, *args: Any, timeout_s: float | None = None, during: str = "") -> Any:
        refs = [getattr(self.actors[rank], method).remote(*args)]
        return self.gather(refs, timeout_s, ranks=[rank], during=during)[0]

    def gather(self, refs: Sequence[Any], timeout_s: float | None = None, ranks: Sequence[int] | None = None,
               during: str = "") -> list[Any]:
        """The results of ``refs`` (one per rank, in ``ranks`` order, default all), whichever finishes first."""
        import ray

        ranks = list(ranks) if ranks is not None else list(range(len(refs)))
        rank_of = {ref: rank for ref, rank in zip(refs, ranks, strict=True)}
        results: dict[int, Any] = {}
        failures: dict[int, RankFailed] = {}
        pending = list(refs)
        grace_until = 0.0
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            wait: float | None
            if failures:
                wait = max(0.0, grace_until - time.monotonic())
            else:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait)
            if not ready:
                if failures:
                    break  # the others are stuck waiting for the failed rank
                raise TimeoutError(f"ranks {sorted(rank_of[r] for r in pending)} did not finish within {timeout_s:g} s")
            ref = ready[0]
            rank = rank_of[ref]
            try:
                results[rank] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:  # the actor process is gone
                failures[rank] = RankFailed(rank, True, exc, self._where(rank), during)
            except ray.exceptions.RayTaskError as exc:  # the method raised
                failures[rank] = RankFailed(rank, False, exc, self._where(rank), during)
            if failures and len(failures) == 1 and rank in failures:
                grace_until = time.monotonic() + FAILURE_GRACE_S
        if failures:
            # A death explains its peers' broken collectives, not the other way round; then the lowest rank.
            raise min(failures.values(), key=lambda f: (not f.died, f.rank))
        return [results[rank] for rank in ranks]

    def _where(self, rank: int) -> str:
        return self.where[rank] if rank < len(self.where) else ""

    def shutdown(self, flush_s: float = SHUTDOWN_FLUSH_S) -> None:
        """Kill every actor and free the placement group; safe to call twice. First, actors that have
        :meth:`~rankmem.ray.rank.RankActor.flush_telemetry` get ``flush_s`` seconds in all to put their
        queued records on disk: an actor whose step failed (its peer died) runs it at once. One still
        blocked in a collective cannot; its sink thread has had the time it was blocked to write."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.actors and self._flushes and flush_s > 0:
            # Whatever fails here, the cluster is going away: kill regardless.
            refs: list[Any] = attempt(lambda: [actor.flush_telemetry.remote(flush_s) for actor in self.actors],
                                      default=[])
            attempt(ray.wait, refs, num_returns=len(refs), timeout=flush_s + 1.0, default=None)
        for actor in self.actors:
            attempt(ray.kill, actor, no_restart=True, default=None)  # already dead, or the cluster going away
        self.actors = []
        if self.pg is not None:
            attempt(remove_placement_group, self.pg, default=None)
            self.pg = None


def _short(resources: dict[str, float]) -> str:
    keep = {k: v for k, v in resources.items() if k in ("CPU", "GPU")}
    return ", ".join(f"{v:g} {k}" for k, v in sorted(keep.items())) or "none"
