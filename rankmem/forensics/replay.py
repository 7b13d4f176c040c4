"""What held the device at a window's peak: a replay of ``torch.cuda.memory._snapshot()`` (segments and
the ring of allocator events) from ``baseline``, the segments at window open, whose ``snapshot`` mark
in the ring starts the replay; without it (an OOM, a ring wrapped past the window's start) the state
before the ring is undone from the end state. Allocated bytes move at ``alloc`` and ``free_requested``
only. The blocks live at the peak (or the last ``oom``) are classed: parameters / gradients /
optimizer by address (the same allocation live at the end), communication (``torch.distributed``
frames: NCCL's buffers are allocated under its Python calls), activations (``phase|module|fwd``
metadata), temporaries (the rest of the window, by first user frame ``fn@file:line``), pre_window.
Pure Python: off the training thread.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries", "communication",
              "pre_window")
_TORCH = f"{os.sep}torch{os.sep}"
_Live = dict[int, tuple[int, int, Mapping[str, Any]]]
"""Block address -> (size, index of its ``alloc`` entry or -1 from before, that entry or block)."""


class Addresses(NamedTuple):
    """Storage addresses (``untyped_storage().data_ptr()``) of what the job owns, by category."""

    parameters: frozenset[int] = frozenset()
    gradients: frozenset[int] = frozenset()
    optimizer: frozenset[int] = frozenset()


def _live(segments: Any, device: int) -> _Live:
    return {int(b["address"]): (int(b["size"]), -1, b) for seg in segments or ()
            if seg.get("device", device) == device
            for b in seg.get("blocks", ()) if b.get("state") == "active_allocated"}


def _user_frame(frames: Sequence[Mapping[str, Any]]) -> str:
    for f in frames or ():
        name = str(f.get("filename", ""))
        if _TORCH not in name and not name.startswith("<"):
            return f"{f.get('name')}@{os.path.basename(name)}:{f.get('line')}"
    return "(no Python frame)"  # the autograd engine's thread, a kernel's workspace


def _classify(entry: Mapping[str, Any]) -> tuple[str, str]:
    frames = entry.get("frames") or ()
    if any("distributed_c10d" in str(f.get("filename")) or "nccl" in str(f.get("name")).lower()
           for f in frames):
        return "communication", _user_frame(frames)
    _, module, stage = (str(entry.get("user_metadata") or "").split("|") + ["", "", ""])[:3]
    if module and stage == "fwd":
        return "activations", module
    frame = _user_frame(frames)
    return "temporaries", f"{frame} in {module}" if module else frame


def replay(snapshot: Mapping[str, Any], baseline: Any = None, addresses: Addresses | None = None,
           top: int = 8, device: int = 0) -> dict[str, Any]:
    """The live set at the window's peak (or its OOM), classed, as a small JSON-ready dict of bytes:
    ``peak_bytes`` (``baseline_bytes`` + the largest rise), ``categories``, ``top`` holders as
    ``[category, label, bytes, blocks]``, ``tag`` (the metadata of the allocation that set the peak),
    ``entries`` replayed, ``unmatched_frees`` and ``wrapped`` (the ring lost the window's start)."""
    traces = snapshot.get("device_traces") or []
    trace: list[Mapping[str, Any]] = list(traces[device]) if device < len(traces) else []
    wrapped, unseen = False, 0
    if baseline is not None:
        active = sum(int(s.get("active_size", 0)) for s in baseline if s.get("device", device) == device)
        marks = [i for i, e in enumerate(trace) if e.get("action") == "snapshot" and e.get("size") == active]
        wrapped, trace, start = not marks, trace[marks[0] + 1 if marks else 0:], _live(baseline, device)
    if baseline is None or wrapped:
        start, unseen = _backwards(_live(snapshot.get("segments"), device), trace)
    final, unmatched, peak_at, oom_at = _forward(start, trace, None)
    at = oom_at if oom_at is not None else peak_at
    live = _forward(start, trace, at)[0] if at >= 0 else dict(start)
    mark = trace[at] if at >= 0 else {}
    owned = _owned(live, final, addresses or Addresses())
    totals = dict.fromkeys(CATEGORIES, 0)
    holders: dict[tuple[str, str], list[int]] = {}
    for addr, (size, serial, entry) in live.items():
        if addr in owned:
            key = (owned[addr], owned[addr])
        elif serial < 0:
            key = ("pre_window", _user_frame(entry.get("frames") or ()))
        else:
            key = _classify(entry)
        totals[key[0]] += size
        held = holders.setdefault(key, [0, 0])
        held[0], held[1] = held[0] + size, held[1] + 1
    ranked = sorted(holders.items(), key=lambda kv: -kv[1][0])[: max(top, 0)]
    return {
        "peak_bytes": sum(totals.values()), "baseline_bytes": sum(s for s, _, _ in start.values()),
        "instant": "oom" if oom_at is not None else "peak",
        "requested_bytes": int(mark.get("size", 0)) if oom_at is not None else None,
        "tag": str(mark.get("user_metadata") or "")[:120] or None, "categories": totals,
        "top": [[cat, label, b, n] for (cat, label), (b, n) in ranked],
        "entries": len(trace), "unmatched_frees": unmatched + unseen, "wrapped": wrapped,
    }


def _backwards(end: _Live, trace: list[Mapping[str, Any]]) -> tuple[_Live, int]:
    """The live blocks before ``trace``'s first entry, undone from the end state, and how many of its
    frees are of blocks whose allocation it does not hold (older than the ring)."""
    state, unseen = dict(end), set()
    for e in reversed(trace):
        if e.get("action") == "alloc":
            state.pop(int(e["addr"]), None)
            unseen.discard(int(e["addr"]))
        elif e.get("action") == "free_requested":
            state[int(e["addr"])] = (int(e["size"]), -1, e)  # context="alloc": the frames are the alloc's
            unseen.add(int(e["addr"]))
    return {a: (s, -1, b) for a, (s, _, b) in state.items()}, len(unseen)


def _forward(start: _Live, trace: list[Mapping[str, Any]],
             stop: int | None) -> tuple[_Live, int, int, int | None]:
    """Replay from ``start``: the live set after entry ``stop`` (after all when None), the frees of
    blocks never seen, the entry that set the peak (-1: none rose above the start), the last ``oom``."""
    live = dict(start)
    total = best = sum(s for s, _, _ in live.values())
    unmatched, peak_at, oom_at = 0, -1, None
    for i, e in enumerate(trace[: None if stop is None else stop + 1]):
        action = e.get("action")
        if action == "alloc":
            addr, size = int(e["addr"]), int(e["size"])
            total += size - live.get(addr, (0,))[0]
            live[addr] = (size, i, e)
            if total > best:
                best, peak_at = total, i
        elif action == "free_requested":
            old = live.pop(int(e["addr"]), None)
            unmatched += old is None  # allocated before the ring's first entry and not in the baseline
            total -= old[0] if old is not None else 0
        elif action == "oom":
            oom_at = i  # the live set as the allocation failed: nothing changed at this entry
    return live, unmatched, peak_at, oom_at


def _owned(live: _Live, final: _Live, addresses: Addresses) -> dict[int, str]:
    """Block address -> category for the instant's blocks that are the same allocation at the end and
    hold a given address (one freed and reused before the end names another tensor)."""
    kept = sorted(a for a, (_, serial, _) in live.items() if final.get(a, (0, -2, {}))[1] == serial)
    out: dict[int, str] = {}
    for category, ptrs in zip(CATEGORIES, addresses, strict=False):
        for ptr in ptrs:
            i = bisect.bisect_right(kept, ptr) - 1
            if ptr and i >= 0 and ptr < kept[i] + live[kept[i]][0]:
                out.setdefault(kept[i], category)
    return out
