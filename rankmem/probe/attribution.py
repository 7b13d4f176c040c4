"""Device memory by owner: device used split into this rank, its siblings, its descendants, strangers
and what no process accounts for. Pure: the figures in, the split out (:mod:`rankmem.probe.nvmlwatch`
reads them).

    used = reserved + nontorch + siblings + descendants + foreign + unattributed

- ``reserved``: this rank's torch caching allocator;
- ``nontorch``: this rank's NVML figure minus ``reserved`` (the CUDA context, NCCL buffers, cuBLAS
  workspaces, any allocation torch's allocator does not make);
- ``siblings``: the job's other ranks on this node (their heartbeats name their host PIDs);
- ``descendants``: this rank's descendant processes (a colocated engine's workers);
- ``foreign``: every other process NVML lists on the device (another job, a stray context);
- ``unattributed``: device used minus the sum of every process NVML lists (managed memory, which
  ``usedGpuMemory`` leaves out (pynvml#63), the driver's reservations, processes NVML cannot see).

A figure that cannot be known is ``None`` with its reason in :attr:`Attribution.reasons`, never 0:
returning 0 for an unknown figure is the bug that over-sized KV budgets (vllm-omni#6249).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PARTS = ("nontorch", "siblings", "descendants", "foreign", "unattributed")
"""The parts besides ``reserved``, in the order the split adds them up."""

NOT_AVAILABLE = "NVML_VALUE_NOT_AVAILABLE"


@dataclass(frozen=True, slots=True)
class Attribution:
    """One split of device used, in bytes; ``None`` where unknown, with the reason in :attr:`reasons`."""

    time: float
    step: int | None
    phase: str | None
    """The phase in progress when it was taken (a sleeping engine shows in phases without rollout)."""
    used: int | None
    reserved: int | None
    own: int | None = None
    """This process's NVML figure (``reserved + nontorch``)."""
    nontorch: int | None = None
    siblings: int | None = None
    descendants: int | None = None
    foreign: int | None = None
    unattributed: int | None = None
    processes: int | None = None
    """How many processes NVML lists on the device."""
    mapping: str = ""
    """How host PIDs were joined with this process's (:mod:`rankmem.probe.pidmap`), or why not."""
    reasons: dict[str, str] = field(default_factory=dict)
    """Part -> why it is ``None``."""
    cost_s: float | None = None
    """Wall time of the process enumeration (NVML takes the driver's lock for it: MangoHud#2104)."""

    def to_event(self) -> dict[str, Any]:
        """The split as an event's ``device.attribution`` table: ``*_bytes`` keys, ``None`` where unknown."""
        table: dict[str, Any] = {"time": self.time, "step": self.step, "phase": self.phase,
                                 "used_bytes": self.used, "reserved_bytes": self.reserved, "own_bytes": self.own}
        table.update({f"{part}_bytes": getattr(self, part) for part in PARTS})
        table.update(processes=self.processes, mapping=self.mapping, reasons=dict(self.reasons))
        return table


@dataclass(frozen=True, slots=True)
class Owners:
    """Whose host PIDs are whose, as far as this rank can tell."""

    own: int | None
    """This process's host PID; None: not mapped."""
    descendants: Collection[int] = ()
    descendants_unmapped: int = 0
    """Descendants whose host PID could not be read (they may hide among ``foreign``)."""
    siblings: Collection[int] = ()
    siblings_unknown: str | None = None
    """Why some sibling rank of this node has no known host PID; None when every one is known."""
    mapping: str = ""


def split(used: int | None, reserved: int | None, processes: Sequence[tuple[int, int | None]] | None,
          owners: Owners, *, refused: str | None = None, time: float = 0.0, step: int | None = None,
          phase: str | None = None, cost_s: float | None = None) -> Attribution:
    """The split of ``used`` given NVML's ``(host pid, usedGpuMemory or None)`` list of the device.

    ``refused``: why the list could not be read (MIG, permissions); every part is then unknown.
    """
    reasons: dict[str, str] = {}
    base = {"time": time, "step": step, "phase": phase, "used": used, "reserved": reserved,
            "mapping": owners.mapping, "cost_s": cost_s}
    if processes is None or refused is not None:
        why = refused or "no process list"
        return Attribution(**base, reasons=dict.fromkeys(PARTS, why))  # type: ignore[arg-type]
    figures: dict[int, int | None] = {}
    for pid, nbytes in processes:  # a process in both the compute and the graphics list counts once
        figures[pid] = nbytes if pid not in figures else _max(figures[pid], nbytes)
    unknown = sorted(pid for pid, nbytes in figures.items() if nbytes is None)
    missing = f"{NOT_AVAILABLE} for pid {', '.join(map(str, unknown))}" if unknown else None
    total = None if missing else sum(v for v in figures.values() if v is not None)
    unattributed = None if total is None or used is None else max(used - total, 0)
    if unattributed is None:
        reasons["unattributed"] = missing or "device used unknown"

    own, mapping_reason = _own(figures, owners, reserved)
    if mapping_reason is not None:
        for part in ("nontorch", "siblings", "descendants", "foreign"):
            reasons[part] = mapping_reason
        return Attribution(**base, unattributed=unattributed, processes=len(figures),  # type: ignore[arg-type]
                           reasons=reasons)
    nontorch = None if own is None or reserved is None else max(own - reserved, 0)
    if own is None:
        reasons["nontorch"] = f"{NOT_AVAILABLE} for this process"
    elif reserved is None:
        reasons["nontorch"] = "reserved unknown"
    descendants = _group(figures, owners.descendants, "descendants", reasons)
    if owners.descendants_unmapped and descendants is not None:
        descendants = None
        reasons["descendants"] = f"{owners.descendants_unmapped} descendant(s) without a readable host PID"
    siblings = _group(figures, owners.siblings, "siblings", reasons)
    if owners.siblings_unknown is not None:
        siblings = None
        reasons["siblings"] = owners.siblings_unknown
    foreign = None
    if total is not None and None not in (own, siblings, descendants):
        foreign = total - (own or 0) - (siblings or 0) - (descendants or 0)
    else:
        reasons["foreign"] = missing or "; ".join(reasons[p] for p in ("siblings", "descendants") if p in reasons)
    return Attribution(**base, own=own, nontorch=nontorch, siblings=siblings,  # type: ignore[arg-type]
                       descendants=descendants, foreign=foreign, unattributed=unattributed,
                       processes=len(figures), reasons=reasons)


def _own(figures: Mapping[int, int | None], owners: Owners, reserved: int | None) -> tuple[int | None, str | None]:
    """This process's figure, or why the host PIDs are not mapped."""
    if owners.own is None:
        return None, owners.mapping or "host PIDs not mapped"
    if owners.own not in figures:
        # A process with a CUDA context is in NVML's list: the join is wrong, not the process absent.
        return None, f"host PIDs not mapped: this process (host pid {owners.own}) is not among NVML's processes"
    return figures[owners.own], None


def _group(figures: Mapping[int, int | None], pids: Collection[int], part: str, reasons: dict[str, str]) -> int | None:
    """The summed figures of ``pids`` on the device (0: none of them holds any); None if one is unknown."""
    listed = [pid for pid in pids if pid in figures]
    unknown = [pid for pid in listed if figures[pid] is None]
    if unknown:
        reasons[part] = f"{NOT_AVAILABLE} for pid {', '.join(map(str, sorted(unknown)))}"
        return None
    return sum(figures[pid] or 0 for pid in listed)


def _max(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else max(a, b)
