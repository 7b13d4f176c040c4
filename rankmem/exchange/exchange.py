"""Every collective rankmem issues goes through this module.

Each function is a collective over ``group``: every rank calls it, on the same steps, in the same
order. With no initialised process group (or a world of one) none of them communicates.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from itertools import repeat
from typing import TYPE_CHECKING, Any

import numpy as np

from rankmem.core.records import RankInfo, RunHeader
from rankmem.core.warnings import WarnOnce
from rankmem.errors import RankmemError
from rankmem.exchange.aggregate import (
    ABSENT,
    QUANTILE_SUFFIXES,
    SUFFIXES,
    Gathered,
    absent_mask,
    aggregate,
    names_of,
    union_matrix,
)
from rankmem.exchange.dist import (
    all_gather_objects,
    detail_every_default,
    dist_active,
    rank_and_world,
    reduce_above_default,
)
from rankmem.exchange.packed import PackedGather, Schema
from rankmem.exchange.reduce import PackedReduce, Reduced, matrix_quantiles

if TYPE_CHECKING:
    from rankmem.probe.device import DeviceBackend


class Exchange:
    """The one collective of a collect: pack, gather, detect mixed keys, fall back, aggregate.

    :meth:`gather_aggregate` is a collective over ``group``: every rank calls it, on the same steps. With no
    process group (or a world of one) nothing is communicated. Ranks that disagree on keys take one pickled
    gather together; from then on every rank packs the agreed union of keys (:data:`ABSENT` where it lacks
    one), capped at :data:`MAX_LAYOUT`; the mixed-keys warning is given for at most :data:`MAX_KEY_WARNINGS`
    key sets.

    Worlds larger than ``reduce_above`` ranks (default :data:`REDUCE_ABOVE`, or ``RANKMEM_REDUCE_ABOVE``)
    take :class:`rankmem.exchange.reduce.PackedReduce`: the per-rank matrix reaches ``detail_rank`` only,
    every ``detail_every`` collects or when a rank passes ``detail=True`` (else :attr:`Gathered.matrix`
    is None), and ``K/p50``, ``K/p90``, ``K/p99`` are added. Every rank must be given the same knobs.
    A collect takes :attr:`turn` around everything it does; misuse that would corrupt or hang the group
    (two collects at once, a forked child, a rank outside the group) is refused before any communication.
    """

    MAX_LAYOUT = 4096
    MAX_KEY_WARNINGS = 8

    def __init__(self, group: Any = None, device_type: str | None = None, device_module: Any = None, *,
                 reduce_above: int | None = None, detail_every: int | None = None, detail_rank: int = 0,
                 quantile_bins: int = 32) -> None:
        # The gather's device is resolved at the first collect, from the backend's current device.
        self.packed = PackedGather(group, device_type, device_module=device_module)
        self.reduce = PackedReduce(self.packed, detail_rank, quantile_bins)
        self.reduce_above = reduce_above if reduce_above is not None else reduce_above_default()
        self.detail_every = max(1, detail_every if detail_every is not None else detail_every_default())
        self._collects = 0
        self._layout: tuple[str, ...] = ()
        self._layout_set: frozenset[str] = frozenset()
        self._order: tuple[str, ...] = ()  # the last collect's keys as given, and the layout sent for them
        self._schema: tuple[str, ...] = ()
        self._warned: set[tuple[str, ...]] = set()
        self._warn_once = WarnOnce()
        self._detail_asked = False
        self.turn = _Turn(self)
        self.header: RunHeader | None = None
        """The run header, on every rank once :meth:`start` has run (at the first collect)."""

    def start(self, log_rank: int, config: dict[str, Any], device: DeviceBackend | None, peak_scope: str,
              run_id: str | None) -> RunHeader:
        """The first collect's handshake, a collective (see :func:`run_header`): this rank's device
        (``none`` without a backend) and the logging rank's ``run_id`` in the header every rank keeps."""
        name, uuid = (device.device_name(), device.device_uuid()) if device is not None else ("none", None)
        self.header = run_header(self.packed.group, log_rank, config, name, peak_scope, uuid, run_id)
        return self.header

    def request_detail(self) -> None:
        """Carry the per-rank matrix at the next :meth:`gather_aggregate`, whatever the cadence. Local:
        one rank asking is enough (a rank that just recorded an event)."""
        self._detail_asked = True

    def gather_aggregate(self, values: Mapping[str, float], step: int | None = None, detail: bool = False
                         ) -> Gathered:
        """``detail=True`` on any rank makes this collect carry the per-rank matrix on the reduce path
        (a rank that just recorded an event); the all-gather path always carries it."""
        detail, self._detail_asked = detail or self._detail_asked, False
        order = tuple(values)
        if order != self._order:  # new keys: their layout is found once, not sorted at every collect
            self._order = order
            in_layout = self._layout_set and self._layout_set.issuperset(order)
            self._schema = self._layout if in_layout else tuple(sorted(order))
        schema = self._schema
        row = list(map(values.get, schema, repeat(ABSENT)))  # no Python frame per key
        step_f = math.nan if step is None else float(step)
        packed = self.packed
        if packed.ready() and packed.world > self.reduce_above:
            # The same collect count on every rank: every rank asks for the detail on the same collects.
            want = detail or self._collects % self.detail_every == 0
            self._collects += 1
            array = np.asarray(row, dtype=np.float64)
            reduced = self.reduce.reduce(packed.signature(schema), array, absent_mask(array), step_f, want)
            if reduced is not None:
                return self._from_reduced(schema, reduced)
            schemas, rows = self.packed.fallback(schema, row, self.reduce.need)
            return self._from_rows(schema, schemas, rows, self.reduce.bins)
        got = self.packed.gather_matrix(schema, row, step_f)
        if isinstance(got, np.ndarray):  # every rank sent this layout: the steady state
            return self._aggregate_matrix(schema, got)
        return self._from_rows(schema, *got)

    def _from_reduced(self, schema: tuple[str, ...], reduced: Reduced) -> Gathered:
        keys: Sequence[str] = schema
        stats, counts, matrix, quantiles = reduced.stats, reduced.counts, reduced.detail, reduced.quantiles
        world = self.packed.world
        mixed = bool(self._layout) and bool((counts < world).any())
        if mixed:
            kept = counts > 0  # keys of the agreed layout that no rank has this time
            if not kept.all():
                keys = [k for k, keep in zip(keys, kept.tolist(), strict=True) if keep]
                stats, counts = stats[kept], counts[kept]
                quantiles = None if quantiles is None else quantiles[kept]
                matrix = None if matrix is None else matrix[:, kept]
            mixed = bool((counts < world).any())  # every rank dropped the same keys: they agree again
            if mixed:
                self._warn_mixed(keys, counts < world)
        if matrix is not None:
            matrix[absent_mask(matrix)] = math.nan  # downstream (run log, leak watch) reads NaN as absent
        aggregated = dict(zip(names_of(keys, SUFFIXES)[0], stats.ravel().tolist(), strict=True))
        if quantiles is not None:
            aggregated.update(zip(names_of(keys, QUANTILE_SUFFIXES)[0], quantiles.ravel().tolist(), strict=True))
        return Gathered(keys, matrix, aggregated, mixed)

    def _from_rows(self, schema: tuple[str, ...], schemas: Sequence[Schema], rows: Sequence[np.ndarray],
                   bins: int = 0) -> Gathered:
        """The aggregates from every rank's values; with ``bins``, the all-reduce path's quantiles too."""
        gathered = self._aggregate_rows(schema, schemas, rows)
        if bins and gathered.matrix is not None:
            absent = np.isnan(gathered.matrix) if gathered.mixed else None  # absent is NaN by now
            quantiles = matrix_quantiles(gathered.matrix, absent, bins)
            if absent is not None:  # NaN cells of a mixed matrix may be a caller's NaN: aggregate knows
                quantiles[np.isnan([gathered.aggregated[k + "/max"] for k in gathered.keys])] = math.nan
            names = names_of(gathered.keys, QUANTILE_SUFFIXES)[0]
            gathered.aggregated.update(zip(names, quantiles.ravel().tolist(), strict=True))
        return gathered

    def _aggregate_rows(self, schema: tuple[str, ...], schemas: Sequence[Schema], rows: Sequence[np.ndarray]
                        ) -> Gathered:
        if all(s == schema for s in schemas):
            return self._aggregate_matrix(schema, np.vstack(rows) if rows else np.zeros((0, 0)))
        keys, matrix = union_matrix(schemas, rows)
        if len(keys) > self.MAX_LAYOUT:  # keys that never repeat: do not carry them forever
            self._layout, self._layout_set, self._order = (), frozenset(), ()
        else:
            self._layout, self._layout_set, self._order = tuple(keys), frozenset(keys), ()
            # Every rank packs the whole union from now on: make room for it in the same step.
            self.packed.capacity = max(self.packed.capacity, len(keys))
        return self._aggregate_matrix(keys, matrix)

    def _aggregate_matrix(self, keys: Sequence[str], matrix: np.ndarray) -> Gathered:
        """The aggregates of a ranks x keys matrix; the keys of the agreed layout that some rank lacks
        (:data:`ABSENT`) are aggregated over the ranks that have them."""
        absent = absent_mask(matrix) if self._layout else None
        if absent is None or not absent.any():
            return Gathered(keys, matrix, aggregate(keys, matrix), mixed=False)
        kept = np.asarray(~absent.all(axis=0))  # keys of the agreed layout that no rank has this time
        if not kept.all():
            keys = [k for k, keep in zip(keys, list(kept), strict=True) if keep]
            matrix, absent = matrix[:, kept], absent[:, kept]
            if not absent.any():  # every rank dropped the same keys: they agree again
                return Gathered(keys, matrix, aggregate(keys, matrix), mixed=False)
        self._warn_mixed(keys, np.asarray(absent.any(axis=0)))
        matrix[absent] = math.nan  # downstream (run log, leak watch) reads NaN as absent
        return Gathered(keys, matrix, aggregate(keys, matrix, absent=absent), mixed=True)

    def _warn_mixed(self, keys: Sequence[str], some_absent: np.ndarray) -> None:
        differing = tuple(k for k, some in zip(keys, list(some_absent), strict=True) if some)
        if differing in self._warned or len(self._warned) > self.MAX_KEY_WARNINGS:
            return
        self._warned.add(differing)
        if len(self._warned) > self.MAX_KEY_WARNINGS:
            self._warn_once("keys-many", f"ranks keep reporting different key sets; "
                            f"no more than {self.MAX_KEY_WARNINGS} are reported")
            return
        self._warn_once("keys:" + ",".join(differing),
                        f"ranks reported different keys {list(differing)}; each is aggregated over the ranks that have "
                        "it")


class _Turn:
    """One collect at a time on the group, by the process that built the exchange. Kept and entered
    again at every collect (a ``with`` on it costs less than building a context manager)."""

    __slots__ = ("_exchange", "_lock", "_pid")

    def __init__(self, exchange: Exchange) -> None:
        self._exchange = exchange
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def __enter__(self) -> None:
        exchange = self._exchange
        group = exchange.packed.group
        if os.getpid() != self._pid and dist_active(group):
            raise RankmemError("collect() in a forked child: the child shares its parent's process group and would "
                               "corrupt it; measure in the child with rankmem.sample() instead")
        # Membership cannot change while the group lives: asked at the first collect only
        # (torch.distributed's lookups cost tens of microseconds right after a step's compute).
        if exchange.header is None and rank_and_world(group)[0] < 0:
            raise RankmemError("this rank is not a member of the Monitor's group: call collect() on the group's "
                               "ranks only, or build the Monitor with group=None")
        if not self._lock.acquire(blocking=False):
            raise RankmemError("collect() is already running in another thread: call it from one thread per rank "
                               "(two collectives at once on one process group corrupt it)")

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def run_header(group: Any, log_rank: int, config: dict[str, Any], device: str, peak_scope: str,
               device_uuid: str | None = None, run_id: str | None = None) -> RunHeader:
    """Who every rank is, once per run, at the first collect (pickled: two collectives, not worth a
    packed layout), and the run's identity: the logging rank's ``run_id``, which every rank adopts. A
    collective; a ``log_rank`` outside the group raises on every rank alike."""
    rank, world = rank_and_world(group)
    if log_rank >= world:  # every rank knows the world size: all raise together
        raise RankmemError(f"log_rank={log_rank} but the group has {world} rank(s): use 0..{world - 1}")
    me = RankInfo(rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", "0")), host=socket.gethostname(),
                  pid=os.getpid(), device=device, peak_rss_scope=peak_scope, device_uuid=device_uuid)
    gathered = all_gather_objects({"info": asdict(me), "run_id": run_id}, group)
    ranks = [RankInfo(**g["info"]) for g in gathered]
    return RunHeader(world_size=world, ranks=ranks, config=config, started=time.time(),
                     run_id=gathered[log_rank]["run_id"])
