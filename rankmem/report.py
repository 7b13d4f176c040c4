"""``rankmem report``: what a run log says about each memory key, worst rank first.

Per key: the worst value over the run (the peak, or the minimum for keys where low is bad, such as
device headroom), the step and rank that hold it, the phase that set it (when the run has phases),
and the imbalance across ranks (max over mean of the per-rank peaks). Then device headroom, host RSS
growth and the leak verdicts of :mod:`rankmem.leaks`. Everything is computed on the arrays of
:func:`rankmem.runlog.read_run`, so a 100k-step log costs little more than reading it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from rankmem._catalogue import PHASE_PREFIX, PHASE_SUFFIX, is_memory_key, key_of, phase_of_peak, worst_stat
from rankmem._events import read_events
from rankmem._scalars import json_safe
from rankmem.leaks import LeakConfig, Trend, detect_leaks, worst_first
from rankmem.runlog import Run


@dataclass
class KeyReport:
    """The worst value of one per-rank key over the run."""

    key: str
    worst: str
    """``"max"`` or ``"min"``: which end is dangerous."""
    value: float
    step: int
    rank: int
    phase: str | None
    """The phase whose own peak equals this step's peak on this rank; ``None`` when not applicable."""
    imbalance: float | None
    """max over mean, across ranks, of each rank's peak over the run (1.0 = balanced)."""


@dataclass
class Growth:
    """How much a per-rank key grew from the first to the last step, for the rank that grew most."""

    key: str
    rank: int
    first: float
    last: float
    mean_growth: float
    """Mean over ranks of (last - first)."""

    @property
    def growth(self) -> float:
        return self.last - self.first


@dataclass
class Report:
    path: str
    world_size: int
    hosts: list[str]
    steps: int
    first_step: int | None
    last_step: int | None
    corrupt: int
    truncated: bool
    keys: list[KeyReport] = field(default_factory=list)
    headroom: KeyReport | None = None
    host_growth: Growth | None = None
    trends: list[Trend] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    """Every rank's forensic events (``oom``, ``near_oom``, ``killed``, ``stalled``), by time."""
    corrupt_events: int = 0

    @property
    def leaks(self) -> list[Trend]:
        """The leaking series, worst first: the soonest to exhaust its memory, then the fastest growing."""
        return worst_first(self.trends)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["leaks"] = [asdict(t) for t in self.leaks]
        if self.host_growth is not None:
            out["host_growth"]["growth"] = self.host_growth.growth
        cleaned: dict[str, Any] = json_safe(out)
        return cleaned


def memory_keys(run: Run) -> list[str]:
    """The run's per-rank memory keys, phase keys aside, sorted."""
    return sorted(k for k in run.series if is_memory_key(k))


def _phase_of(run: Run, key: str, row: int, rank: int, value: float) -> str | None:
    if key not in PHASE_SUFFIX:
        return None
    rank_values = {k: float(m[row, rank]) for k, m in run.series.items() if k.startswith(PHASE_PREFIX)}
    return phase_of_peak(key, value, rank_values)


def key_report(run: Run, key: str) -> KeyReport | None:
    """The worst value of ``key`` with its step, rank, phase and imbalance; None if never present."""
    matrix = run.series[key]
    if matrix.size == 0 or not np.isfinite(matrix).any():
        return None
    worst = worst_stat(key)
    low = worst == "min"
    filled = np.where(np.isfinite(matrix), matrix, np.inf if low else -np.inf)
    # argmin/argmax over the flattened (step, rank) array: ties go to the earliest step, then lowest rank.
    flat = int(filled.argmin() if low else filled.argmax())
    row, rank = divmod(flat, matrix.shape[1])
    value = float(matrix[row, rank])
    imbalance = None
    if not low:
        with np.errstate(invalid="ignore"):
            per_rank = np.nanmax(np.where(np.isfinite(matrix), matrix, np.nan), axis=0)
        per_rank = per_rank[np.isfinite(per_rank)]
        mean = float(per_rank.mean()) if per_rank.size else math.nan
        imbalance = float(per_rank.max()) / mean if per_rank.size and mean > 0 else None
    return KeyReport(
        key=key,
        worst=worst,
        value=value,
        step=int(run.steps[row]),
        rank=rank,
        phase=_phase_of(run, key, row, rank, value),
        imbalance=imbalance,
    )


def growth(run: Run, key: str) -> Growth | None:
    """First-to-last change of ``key`` per rank (each rank's own first and last finite value)."""
    matrix = run.series.get(key)
    if matrix is None:
        return None
    best: Growth | None = None
    changes = []
    for rank in range(matrix.shape[1]):
        col = matrix[:, rank]
        ok = np.flatnonzero(np.isfinite(col))
        if ok.size < 2:
            continue
        first, last = float(col[ok[0]]), float(col[ok[-1]])
        changes.append(last - first)
        if best is None or last - first > best.growth:
            best = Growth(key=key, rank=rank, first=first, last=last, mean_growth=0.0)
    if best is not None:
        best.mean_growth = float(np.mean(changes))
    return best


def build_report(run: Run, leak_config: LeakConfig | None = None) -> Report:
    events = read_events(run.path)
    steps = run.steps
    report = Report(
        path=run.path,
        world_size=run.world_size,
        hosts=sorted({str(r.get("host")) for r in run.header.get("ranks", []) if isinstance(r, dict)}),
        steps=int(steps.size),
        first_step=int(steps[0]) if steps.size else None,
        last_step=int(steps[-1]) if steps.size else None,
        corrupt=run.corrupt,
        truncated=run.truncated,
        events=events.events,
        corrupt_events=events.corrupt,
    )
    for key in memory_keys(run):
        kr = key_report(run, key)
        if kr is not None:
            report.keys.append(kr)
            if key == key_of("headroom"):
                report.headroom = kr
    report.host_growth = growth(run, key_of("rss"))
    report.trends = detect_leaks(run, config=leak_config)
    return report


def _fmt(value: float, key: str) -> str:
    return f"{value:.3f}" if key.endswith("_gib") else f"{value:g}"


def render(report: Report) -> None:
    """Print the report with rich: a summary, one table row per key, then headroom, growth and leaks."""
    import sys

    from rich import box
    from rich.console import Console
    from rich.table import Table

    # A fixed width off a terminal keeps piped output and tests stable.
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 120, highlight=False)
    for line in event_lines(report):  # what happened comes first: it is why the report is opened
        console.print(line, markup=False)
    for line in summary_lines(report):
        console.print(line, markup=False)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name, justify in (("key", "left"), ("worst", "right"), ("unit", "left"), ("step", "right"),
                          ("rank", "right"), ("phase", "left"), ("max/mean", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for k in report.keys:
        table.add_row(
            k.key,
            f"{k.worst} {_fmt(k.value, k.key)}",
            "GiB" if k.key.endswith("_gib") else "",
            str(k.step),
            str(k.rank),
            k.phase or "",
            f"{k.imbalance:.2f}" if k.imbalance is not None else "",
        )
    if report.keys:
        console.print(table)
    for line in verdict_lines(report):
        console.print(line, markup=False, soft_wrap=True)  # a leak's verdict is one line, whatever its length


def event_lines(report: Report) -> list[str]:
    """One line per event: ``EVENT oom rank 1 step 3 phase update: host MemoryError ...``."""
    lines = [f"EVENT {describe_event(e)}" for e in report.events]
    if report.corrupt_events:
        lines.append(f"events: {report.corrupt_events} torn or corrupt line(s) skipped")
    return lines


def describe_event(e: Mapping[str, Any]) -> str:
    where = f"{e.get('kind')} rank {e.get('rank')} step {e.get('step')} phase {e.get('phase') or '-'}"
    kind = e.get("kind")
    if kind == "oom":
        what = f"{e.get('where')} {e.get('error') or ''}".strip()
        requested = e.get("requested_bytes")
        if isinstance(requested, (int, float)):
            what += f"; requested {requested / 2**30:.3f} GiB"
        device = e.get("device") or {}
        if isinstance(device.get("free_bytes"), (int, float)) and isinstance(device.get("total_bytes"), (int, float)):
            what += f"; device free {device['free_bytes'] / 2**30:.3f} of {device['total_bytes'] / 2**30:.3f} GiB"
        host = e.get("host") or {}
        if isinstance(host.get("rss_bytes"), (int, float)):
            what += f"; RSS {host['rss_bytes'] / 2**30:.3f} GiB"
        return f"{where}: {what}"
    if kind == "near_oom":
        return f"{where}: {', '.join(map(str, e.get('reasons') or [])) or 'low headroom'}"
    rss = e.get("last_rss_bytes")
    last = f", last RSS {rss / 2**30:.3f} GiB" if isinstance(rss, (int, float)) else ""
    if kind == "killed":
        return f"{where}: killed by {e.get('signal')}{last}; cause {e.get('cause')}"
    if kind == "stalled":
        age = e.get("heartbeat_age_s")
        age_text = f"{age:.0f} s" if isinstance(age, (int, float)) else "?"
        return f"{where}: no heartbeat for {age_text}{last}; process state {e.get('process_state')}"
    return where


def summary_lines(report: Report) -> list[str]:
    lines = [f"run log: {report.path}"]
    span = f"steps {report.first_step}..{report.last_step}" if report.steps else "no steps"
    hosts = f"{len(report.hosts)} host{'s' if len(report.hosts) != 1 else ''}"
    lines.append(f"{report.world_size} ranks on {hosts}, {report.steps} logged steps ({span})")
    if report.corrupt or report.truncated:
        lines.append(
            f"skipped: {report.corrupt} corrupt line{'s' if report.corrupt != 1 else ''}, "
            f"{'a truncated last line' if report.truncated else 'no truncated last line'}"
        )
    return lines


def verdict_lines(report: Report) -> list[str]:
    lines = []
    if report.headroom is not None:
        h = report.headroom
        lines.append(f"device headroom: min {h.value:.3f} GiB at step {h.step} on rank {h.rank}")
    if report.host_growth is not None:
        g = report.host_growth
        lines.append(
            f"host RSS growth (first to last step): {g.growth * 1024:+.1f} MiB on rank {g.rank} "
            f"(mean over ranks {g.mean_growth * 1024:+.1f} MiB)"
        )
    leaks = report.leaks
    if leaks:
        lines += [f"LEAK {t.describe()}" for t in leaks]
    elif report.trends:
        lines.append(f"leaks: none found ({len(report.trends)} rank series checked)")
    else:
        lines.append("leaks: not checked (too few steps)")
    return lines
