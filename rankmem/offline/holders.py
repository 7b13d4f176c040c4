"""What held the peak, compared across ranks: the report's lines from every rank's ``anatomy`` events.

Each event (written by :mod:`rankmem.forensics.sampler`) holds one replayed window: category totals
and the top holders in bytes. An OOM's replay is named as it is; of the sampled windows, each rank's
heaviest is set against the median rank's, category by category, and the rank that peaked highest is
told by its largest excess and its top holder there. Another process wrote the events: every field is
checked before use (a bad one drops that event, never the report).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from rankmem.core.eventrecords import Event
from rankmem.core.text import printable

ANATOMY = "anatomy"


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if abs(n) >= 2**28 else f"{n / 2**20:.1f} MiB"


def _window(e: Event) -> tuple[dict[str, int], list[tuple[str, str, int]], int] | None:
    """Categories, top holders and peak of one event; None where a field is not what the writer writes."""
    cats, top, peak = e.extra.get("categories"), e.extra.get("top"), e.extra.get("peak_bytes")
    if e.rank is None or not isinstance(cats, Mapping) or not isinstance(top, list) or type(peak) is not int:
        return None
    if not all(isinstance(k, str) and type(v) is int for k, v in cats.items()):
        return None
    holders = [(printable(h[0])[:40], printable(h[1])[:120], h[2]) for h in top[:8]
               if isinstance(h, list) and len(h) >= 3 and type(h[2]) is int]
    return dict(cats), holders, peak


def _top_in(holders: Sequence[tuple[str, str, int]], category: str) -> str:
    named = [f"{label} {_size(b)}" for cat, label, b in holders if cat == category][:2]
    return f", top: {', '.join(named)}" if named else ""


def holder_lines(events: Sequence[Event]) -> list[str]:
    """``rank 5: activations +9.1 GiB over the median rank, top: lm_head 6.0 GiB`` and the OOM replays."""
    lines: list[str] = []
    heaviest: dict[int, tuple[dict[str, int], list[tuple[str, str, int]], int, Event]] = {}
    for e in events:
        window = _window(e) if e.kind == ANATOMY else None
        if window is None or e.rank is None:
            continue
        cats, holders, peak = window
        if e.extra.get("instant") == "oom":
            shown = ", ".join(f"{c} {_size(b)}" for c, b in sorted(cats.items(), key=lambda kv: -kv[1]) if b)
            top = "; top: " + ", ".join(f"{label} ({cat}) {_size(b)}" for cat, label, b in holders[:3])
            lines.append(f"rank {e.rank} OOM at step {e.step} ({printable(e.phase or '-')}): {shown}{top}")
        elif e.rank not in heaviest or peak > heaviest[e.rank][2]:
            heaviest[e.rank] = (cats, holders, peak, e)
    if len(heaviest) == 1:
        ((rank, (cats, holders, peak, e)),) = heaviest.items()
        shown = ", ".join(f"{c} {_size(b)}" for c, b in cats.items() if b)
        top = _top_in(holders, holders[0][0]) if holders else ""
        lines.append(f"rank {rank} step {e.step}: peak {_size(peak)} = {shown}{top}")
    elif heaviest:
        names = sorted({c for cats, _, _, _ in heaviest.values() for c in cats})
        median = {c: statistics.median(w[0].get(c, 0) for w in heaviest.values()) for c in names}
        rank, (cats, holders, peak, _) = max(heaviest.items(), key=lambda kv: (kv[1][2], -kv[0]))
        excess = max(names, key=lambda c: cats.get(c, 0) - median[c])
        over = cats.get(excess, 0) - median[excess]
        sign = "+" if over >= 0 else "-"
        lines.append(f"rank {rank}: {excess} {sign}{_size(abs(over))} over the median rank "
                     f"(peak {_size(peak)} vs {_size(statistics.median(w[2] for w in heaviest.values()))})"
                     f"{_top_in(holders, excess)}")
    return lines
