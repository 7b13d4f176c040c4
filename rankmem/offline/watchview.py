"""How ``rankmem watch`` draws a :class:`~rankmem.offline.watch.Frame`, and its ``--json`` form.

In the manner of nvitop: each memory cell is coloured by its share of the limit that binds it (the
device total for device memory, the least of node total and cgroup limit for host memory), yellow from
:data:`WARN_SHARE`, red from :data:`DANGER_SHARE`, and plain below: a healthy job is not red. A small
bar per rank shows its largest share. The worst rank of a column is marked ``*`` in bold, not in red
(the highest is not a danger by itself). Killed ranks read ``dead`` and cleanly exited ones
``exited``, with no phase. The screen names one step: the step of the memory shown; each rank's own
step is written relative to it (``+2``: two steps past it). The title fits 80 columns.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict
from typing import Any

from rankmem.core.events import KILLED, OOM
from rankmem.core.scalars import to_float
from rankmem.core.text import printable
from rankmem.offline.report import describe_event
from rankmem.offline.watch import Frame, RankRow

WARN_SHARE = 0.80
DANGER_SHARE = 0.90
BAR_WIDTH = 10
WORST_MARK = "*"


def shown_step(frame: Frame) -> int | None:
    """The one step on the screen: the step of the per-rank memory shown."""
    return frame.detail_step if frame.detail_step is not None else frame.step


def share(frame: Frame, key: str, rank: int) -> float | None:
    """``key``'s value on ``rank`` as a share of its binding limit; None where either is unknown."""
    value = frame.rows[rank].values.get(key)
    limits = frame.limits.get(key)
    limit = limits[rank] if limits is not None and rank < len(limits) else None
    if value is None or limit is None or not limit > 0:
        return None
    return value / limit


def top_share(frame: Frame, rank: int) -> float | None:
    shares = [s for _, key in frame.columns if (s := share(frame, key, rank)) is not None]
    return max(shares) if shares else None


def share_style(value: float | None) -> str:
    if value is None or value < WARN_SHARE:
        return ""
    return "yellow" if value < DANGER_SHARE else "red"


def state(row: RankRow, stale_s: float) -> str:
    if row.dead:
        return "dead"
    if row.exited:
        return "exited"
    if row.beat_age_s is not None and row.beat_age_s > stale_s:
        return "stale"
    return "running" if row.phase is not None else "unknown"


def frame_json(frame: Frame, stale_s: float = 30.0) -> dict[str, Any]:
    """The frame as plain JSON (``watch --once --json``): what the screen shows, with each rank's state
    and shares of its limits."""
    doc = asdict(frame)
    doc["events"] = [e.to_json() for e in frame.events]  # each as its line holds it, not as the record nests
    doc["shown_step"] = shown_step(frame)
    for row, out in zip(frame.rows, doc["rows"], strict=True):
        out["state"] = state(row, stale_s)
        out["shares"] = {key: share(frame, key, row.rank) for _, key in frame.columns}
    doc["thresholds"] = {"warn": WARN_SHARE, "danger": DANGER_SHARE}
    doc["advice"] = frame.advice.to_json() if frame.advice is not None else None
    return doc


# ---- text -------------------------------------------------------------------------------------------

def _clock(t: Any) -> str:
    """An event's time as HH:MM:SS; ``?`` for one that is not a time (another process wrote the line)."""
    t = to_float(t)  # None for a string, or an int no float holds (10**4000)
    if t is None or not math.isfinite(t):
        return "?"
    try:
        return time.strftime("%H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError):
        return "?"


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 48 * 3600 else f"{seconds / 86400:.0f} d"


def _where(run_dir: str) -> str:
    cwd = os.getcwd()
    return os.path.relpath(run_dir, cwd) if run_dir.startswith(cwd + os.sep) else run_dir


def title_lines(frame: Frame, width: int | None = None) -> list[str]:
    """The title; with ``width``, the run directory is shortened in its middle so the line fits it."""
    where = printable(_where(frame.run_dir))  # the run's own strings are shown as text, escaped
    parts = [f"rankmem watch {where}", f"{frame.world_size} ranks"]
    if frame.hosts:
        parts.append(f"{len(frame.hosts)} host{'s' if len(frame.hosts) != 1 else ''}")
    step = shown_step(frame)
    if step is None:
        parts.append("no step logged yet")
    else:
        ago = f" ({_age(max(0.0, frame.now - frame.logged_at))} ago)" if frame.logged_at is not None else ""
        parts.append(f"step {step}{ago}")
        if frame.step_time_s is not None:
            parts.append(f"{frame.step_time_s:.3f} s/step")
    lines = [" · ".join(parts)]
    over = len(lines[0]) - width if width is not None else 0
    if over > 0 and len(where) - over - 1 >= 1:
        keep = len(where) - over - 1
        short = where[: keep // 2] + "…" + where[len(where) - (keep - keep // 2):]
        lines[0] = " · ".join([f"rankmem watch {short}", *parts[1:]])
    if frame.detail_note:
        lines.append(printable(f"note: {frame.detail_note}"))
    if frame.capacity:
        lines.append("limits: " + " · ".join(f"{label} {value:.1f} GiB" for label, value in frame.capacity))
    return lines


def _step_cell(row: RankRow, step: int | None) -> str:
    if row.step is None or row.dead or row.exited:
        return ""
    if step is None:
        return str(row.step)
    delta = row.step - step
    return "" if delta == 0 else f"{delta:+d}"


def _phase_cell(row: RankRow) -> Any:
    from rich.text import Text

    if row.dead:
        return Text("dead", "bold red")  # a killed rank is a danger: the one red a healthy job never shows
    if row.exited:
        return Text("exited", "dim")
    return Text(printable("?" if row.phase is None else row.phase or "-"))


def _bar(value: float | None) -> Any:
    from rich.text import Text

    if value is None:
        return Text("")
    filled = min(BAR_WIDTH, int(max(0.0, value) * BAR_WIDTH))
    text = Text("█" * filled + "░" * (BAR_WIDTH - filled), share_style(value) or "green")
    text.append(f" {value * 100:3.0f}%", share_style(value))
    return text


class _Title:
    """The title lines, fitted to the width they are drawn at."""

    def __init__(self, frame: Frame) -> None:
        self.frame = frame

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.text import Text

        for line in title_lines(self.frame, options.max_width):
            # The title fits the width; a note (damage, a skipped file) wraps: its end says what happened.
            yield Text(line) if line.startswith("note: ") else Text(line, no_wrap=True, overflow="ellipsis")


def _rank_row(frame: Frame, row: RankRow, step: int | None, stale_s: float) -> list[Any]:
    from rich.text import Text

    age = "" if row.beat_age_s is None else _age(row.beat_age_s)
    # A rank whose last beat is old while the job goes on is the one to look at.
    age_style = "yellow" if state(row, stale_s) == "stale" else ""
    cells: list[Any] = [str(row.rank), _step_cell(row, step), _phase_cell(row), Text(age, age_style)]
    for _, key in frame.columns:
        value = row.values.get(key)
        if value is None:
            cells.append("")
            continue
        worst = frame.worst.get(key) == row.rank
        style = " ".join(s for s in (share_style(share(frame, key, row.rank)), "bold" if worst else "") if s)
        cells.append(Text(f"{value:.3f}{WORST_MARK if worst else ' '}", style))
    cells.append(_bar(top_share(frame, row.rank)))
    return cells


def render_frame(frame: Frame, stale_s: float = 30.0) -> Any:
    """The frame as a rich renderable: title, one row per rank, a legend, the newest events."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [_Title(frame)]
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name, justify in (("rank", "right"), ("step", "right"), ("phase", "left"), ("beat", "right")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for label, key in frame.columns:
        table.add_column(f"{label}\n{'GiB' if key.endswith('_gib') else ''}", justify="right", no_wrap=True)
    table.add_column("of limit", no_wrap=True, min_width=BAR_WIDTH + 5)
    step = shown_step(frame)
    for row in frame.rows:
        table.add_row(*_rank_row(frame, row, step, stale_s))
    parts.append(table)
    legend = [f"step: each rank's own, relative to step {step}"] if step is not None else []
    if frame.worst:
        legend.append(f"{WORST_MARK} the worst rank of the column")
    legend.append(f"yellow from {WARN_SHARE:.0%}, red from {DANGER_SHARE:.0%} of the binding limit")
    parts.append(Text("; ".join(legend), "dim"))
    parts += [Text(printable("what fills the peak: " + line)) for line in frame.anatomy]
    if frame.event_count:
        parts.append(Text(f"events ({frame.event_count}, newest last):"))
        for e in frame.events:
            parts.append(Text(printable(f"  {_clock(e.time)} {describe_event(e)}"),
                              "red" if e.kind in (OOM, KILLED) else ""))
    else:
        parts.append(Text("events: none"))
    return Group(*parts)
