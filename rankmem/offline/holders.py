"""What held the peak, compared across ranks: the report's lines from every rank's ``anatomy`` events
(:mod:`rankmem.forensics.sampler`: a replayed window's category totals and top holders, in bytes).
An OOM's replay is named as it is; each rank's heaviest sampled window is set against the median
rank's, and the rank that peaked highest is told by its largest excess and its top holders there.
Another process wrote the events: a field not of the writer's type drops that event, never the report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rankmem.core.events import Event
from rankmem.core.text import printable

ANATOMY = "anatomy"
_Window = tuple[dict[str, int], list[tuple[str, str, int]], int, Event]


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if abs(n) >= 2**28 else f"{n / 2**20:.1f} MiB"


def _window(e: Event) -> _Window | None:
    cats, top, peak = e.extra.get("categories"), e.extra.get("top"), e.extra.get("peak_bytes")
    if e.kind != ANATOMY or e.rank is None or not isinstance(cats, Mapping) or not isinstance(top, list):
        return None
    if type(peak) is not int or not all(isinstance(k, str) and type(v) is int for k, v in cats.items()):
        return None
    holders = [(printable(h[0])[:40], printable(h[1])[:120], h[2]) for h in top[:8]
               if isinstance(h, list) and len(h) >= 3 and type(h[2]) is int]
    return dict(cats), holders, peak, e


def _top(holders: Sequence[tuple[str, str, int]], category: str) -> str:
    named = [f"{label} {_size(b)}" for cat, label, b in holders if cat == category][:2]
    return f", top: {', '.join(named)}" if named else ""


def holder_lines(events: Sequence[Event]) -> list[str]:
    """``rank 5: activations +9.1 GiB over the median rank (...), top: lm_head 6.0 GiB`` and OOM replays."""
    lines: list[str] = []
    heaviest: dict[int, _Window] = {}
    for w in filter(None, map(_window, events)):
        cats, holders, peak, e = w
        if e.extra.get("instant") == "oom":
            shown = ", ".join(f"{c} {_size(b)}" for c, b in sorted(cats.items(), key=lambda kv: -kv[1]) if b)
            top = ", ".join(f"{label} ({cat}) {_size(b)}" for cat, label, b in holders[:3])
            where = f"step {e.step} ({printable(e.phase or '-')})"
            lines.append(f"rank {e.rank} OOM at {where}: {shown}; top: {top}")
        elif e.rank not in heaviest or peak > heaviest[e.rank][2]:  # type: ignore[index]
            heaviest[e.rank] = w  # type: ignore[index]
    if len(heaviest) == 1:
        ((rank, (cats, holders, peak, e)),) = heaviest.items()
        shown = ", ".join(f"{c} {_size(b)}" for c, b in cats.items() if b)
        lines.append(f"rank {rank} step {e.step}: peak {_size(peak)} = {shown}"
                     f"{_top(holders, holders[0][0]) if holders else ''}")
    elif heaviest:
        names = sorted({c for w in heaviest.values() for c in w[0]})
        import statistics  # here: ~3 ms of every `rankmem report`'s start

        median = {c: statistics.median(w[0].get(c, 0) for w in heaviest.values()) for c in names}
        rank, (cats, holders, peak, _) = max(heaviest.items(), key=lambda kv: (kv[1][2], -kv[0]))
        excess = max(names, key=lambda c: cats.get(c, 0) - median[c])
        over = cats.get(excess, 0) - median[excess]
        typical = _size(statistics.median(w[2] for w in heaviest.values()))
        sign = "+" if over >= 0 else "-"
        lines.append(f"rank {rank}: {excess} {sign}{_size(abs(over))} over the median rank "
                     f"(peak {_size(peak)} vs {typical}){_top(holders, excess)}")
    return lines
