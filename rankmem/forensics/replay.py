"""What held the device at a window's peak: a replay of the allocator's history for that window.

The input is what ``torch.cuda.memory._snapshot()`` returns (``segments``: the live blocks now;
``device_traces``: the ring of allocator events, each with ``action``, ``addr``, ``size``, ``stream``,
Python ``frames`` innermost first, ``user_metadata`` and ``time_us`` where the torch version records
them) and, for a sampled window, ``baseline``: the segments at window open, taken by
``memory_snapshot(include_traces=False)`` right after recording began. That call leaves a ``snapshot``
entry whose size is the active bytes it saw: the replay starts after it. Without that mark (an OOM
snapshot, or a ring that wrapped past the window's start) the state before the first entry kept is
derived backwards from the end state, exact for the span the ring still holds.

Allocated bytes change at ``alloc`` and ``free_requested`` (the allocator's ``allocated_bytes`` stat);
``free_completed`` (a block freed on one stream waits for the others) and segment events move no
allocated byte. The instant is the window's peak, or the last ``oom`` entry where one failed. Each
block live then is classed:

- ``parameters`` / ``gradients`` / ``optimizer``: a block still live at the end that holds one of the
  addresses given (storage ``data_ptr``s; a flat buffer holding many counts once);
- ``communication``: allocated under an ``nccl:`` annotation or from ``torch.distributed`` frames;
- ``activations``: allocated in a module's forward with grad enabled (``phase|module|fwd`` metadata);
- ``temporaries``: anything else allocated in the window, by first user frame (``fn@file:line``);
- ``pre_window``: live since before the window (or before the ring's first entry).

Pure Python, no torch: it runs on the sink's replay thread, or offline on a pickled snapshot.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries", "communication",
              "pre_window")
_OWNED = CATEGORIES[:3]
_TORCH = f"{os.sep}torch{os.sep}"


@dataclass(frozen=True)
class Addresses:
    """Storage addresses (``untyped_storage().data_ptr()``) of what the job owns, by category."""

    parameters: frozenset[int] = field(default_factory=frozenset)
    gradients: frozenset[int] = field(default_factory=frozenset)
    optimizer: frozenset[int] = field(default_factory=frozenset)


def _live(segments: Any, device: int) -> dict[int, tuple[int, int, Mapping[str, Any]]]:
    """``addr -> (size, -1, block)`` of the blocks a snapshot's segments hold allocated."""
    out: dict[int, tuple[int, int, Mapping[str, Any]]] = {}
    for seg in segments or ():
        if seg.get("device", device) != device:
            continue
        for block in seg.get("blocks", ()):
            if block.get("state") == "active_allocated":
                out[int(block["address"])] = (int(block["size"]), -1, block)
    return out


def _user_frame(frames: Sequence[Mapping[str, Any]]) -> str:
    for f in frames or ():
        name = str(f.get("filename", ""))
        if _TORCH not in name and not name.startswith("<"):
            return f"{f.get('name')}@{os.path.basename(name)}:{f.get('line')}"
    return "(no Python frame)"  # the autograd engine's thread, a kernel's workspace


def _nccl_spans(snapshot: Mapping[str, Any]) -> list[tuple[int, int, str]]:
    """``(start_us, end_us, name)`` of the ``nccl:*`` record_function ranges the snapshot annotates."""
    spans, open_at = [], {}
    for a in snapshot.get("external_annotations") or ():
        name = str(a.get("name", ""))
        if name.startswith("nccl:"):
            if a.get("stage") == "START":
                open_at[name] = int(a.get("time_us", 0))
            elif name in open_at:
                spans.append((open_at.pop(name), int(a.get("time_us", 0)), name))
    return spans


def _classify(entry: Mapping[str, Any], spans: list[tuple[int, int, str]]) -> tuple[str, str]:
    frames = entry.get("frames") or ()
    when = entry.get("time_us")
    for start, end, name in spans:
        if when is not None and start <= when <= end:
            return "communication", name
    if any("distributed" in str(f.get("filename", "")) and "nccl" in str(f.get("name", "")).lower()
           or "distributed_c10d" in str(f.get("filename", "")) for f in frames):
        return "communication", _user_frame(frames)
    phase, module, stage = (str(entry.get("user_metadata") or "").split("|") + ["", "", ""])[:3]
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
    end = _live(snapshot.get("segments"), device)
    first, wrapped = 0, False
    if baseline is not None:
        start = _live(baseline, device)
        active = sum(int(b.get("active_size", 0)) for b in baseline if b.get("device", device) == device)
        marks = [i for i, e in enumerate(trace) if e.get("action") == "snapshot" and e.get("size") == active]
        wrapped = not marks
        first = marks[0] + 1 if marks else 0
    trace = trace[first:]
    unseen = 0
    if baseline is None or wrapped:
        start, unseen = _backwards(end, trace)
    final, unmatched, peak_at, oom_at = _forward(start, trace, None)
    at = oom_at if oom_at is not None else peak_at
    live = _forward(start, trace, at)[0] if at >= 0 else dict(start)
    mark = trace[oom_at] if oom_at is not None else trace[peak_at] if peak_at >= 0 else {}
    spans = _nccl_spans(snapshot)
    owned = _owned(live, final, addresses or Addresses())
    totals = dict.fromkeys(CATEGORIES, 0)
    holders: dict[tuple[str, str], list[int]] = {}
    for addr, (size, serial, entry) in live.items():
        if addr in owned:
            key = (owned[addr], owned[addr])
        elif serial < 0:
            key = ("pre_window", _user_frame(entry.get("frames") or ()))
        else:
            key = _classify(entry, spans)
        totals[key[0]] += size
        held = holders.setdefault(key, [0, 0])
        held[0] += size
        held[1] += 1
    ranked = sorted(holders.items(), key=lambda kv: -kv[1][0])[: max(top, 0)]
    return {
        "peak_bytes": sum(totals.values()), "baseline_bytes": sum(s for s, _, _ in start.values()),
        "instant": "oom" if oom_at is not None else "peak",
        "requested_bytes": int(mark.get("size", 0)) if oom_at is not None else None,
        "tag": str(mark.get("user_metadata") or "")[:120] or None, "categories": totals,
        "top": [[cat, label, b, n] for (cat, label), (b, n) in ranked],
        "entries": len(trace), "unmatched_frees": unmatched + unseen, "wrapped": wrapped,
    }


def _backwards(end: dict[int, tuple[int, int, Mapping[str, Any]]],
               trace: list[Mapping[str, Any]]) -> tuple[dict[int, tuple[int, int, Mapping[str, Any]]], int]:
    """The live blocks before ``trace``'s first entry, undoing it from the end state, and how many of
    the frees it holds are of blocks whose allocation it does not hold (older than the ring)."""
    state = dict(end)
    unseen: set[int] = set()
    for e in reversed(trace):
        action = e.get("action")
        if action == "alloc":
            state.pop(int(e["addr"]), None)
            unseen.discard(int(e["addr"]))
        elif action == "free_requested":
            state[int(e["addr"])] = (int(e["size"]), -1, e)  # context="alloc": the frames are the alloc's
            unseen.add(int(e["addr"]))
    return {a: (s, -1, b) for a, (s, _, b) in state.items()}, len(unseen)


def _forward(start: dict[int, tuple[int, int, Mapping[str, Any]]], trace: list[Mapping[str, Any]],
             stop: int | None) -> tuple[dict[int, tuple[int, int, Mapping[str, Any]]], int, int, int | None]:
    """Replay from ``start``: the live set after entry ``stop`` (after all when None), the frees of
    blocks never seen, the entry that set the peak (-1: none rose above the start) and the last ``oom``."""
    live = dict(start)
    total = best = sum(s for s, _, _ in live.values())
    unmatched, peak_at, oom_at = 0, -1, None
    for i, e in enumerate(trace[: None if stop is None else stop + 1]):
        action = e.get("action")
        if action == "alloc":
            addr, size = int(e["addr"]), int(e["size"])
            old = live.get(addr)
            total += size - (old[0] if old is not None else 0)
            live[addr] = (size, i, e)
            if total > best:
                best, peak_at = total, i
        elif action == "free_requested":
            old = live.pop(int(e["addr"]), None)
            if old is None:
                unmatched += 1  # allocated before the ring's first entry and not in the baseline
            else:
                total -= old[0]
        elif action == "oom":
            oom_at = i  # the live set as the allocation failed: nothing changed at this entry
    return live, unmatched, peak_at, oom_at


def _owned(live: Mapping[int, tuple[int, int, Any]], final: Mapping[int, tuple[int, int, Any]],
           addresses: Addresses) -> dict[int, str]:
    """Block address -> category for the peak's blocks that are still the same allocation at the end
    and hold a given address (an address freed and reused before the end names another tensor)."""
    kept = sorted(a for a, (s, serial, _) in live.items() if final.get(a, (0, -2))[1] == serial)
    out: dict[int, str] = {}
    for category in _OWNED:
        for ptr in _iter(getattr(addresses, category)):
            i = bisect.bisect_right(kept, ptr) - 1
            if i >= 0 and ptr < kept[i] + live[kept[i]][0]:
                out.setdefault(kept[i], category)
    return out


def _iter(values: Iterable[int]) -> Iterable[int]:
    return (int(v) for v in values if v)
