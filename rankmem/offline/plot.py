"""``rankmem plot``: one panel per key, one line per rank against step, drawn with matplotlib (Agg).

- **Which phase**: on each rank's :data:`MARKS_PER_RANK` highest steps (no two closer than
  :data:`MARK_GAP_PX` pixels), a marker in the rank's colour, one shape per phase, names the phase that
  raised the peak (:func:`rankmem.core.catalogue.peak_phase`); a grey marker where none or several did.
- **Legends outside the data**, to the right of each panel.
- **How close to OOM**: the capacity that bounds the key (:mod:`rankmem.fit.capacity`) is a dashed line,
  drawn on the panel where it is within :data:`NEAR` times the data, else only named in the legend.
- **No staircases**: the y range spans at least :data:`MIN_SPAN_GIB`, and a panel widened so says the
  data's actual range in MiB.
- The worst rank is drawn thicker and named in the legend; events are red vertical lines at their step.

matplotlib is imported only here: ``pip install 'rankmem[plot]'``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from rankmem.core.catalogue import PHASE_PREFIX, PHASE_SUFFIX, PLOT_KEYS, peak_phase, worse
from rankmem.core.events import Event
from rankmem.core.guard import load_optional
from rankmem.core.rundir import replace_file
from rankmem.core.text import printable
from rankmem.errors import MissingExtraError, RankmemError
from rankmem.fit.capacity import Capacity, capacities, for_key
from rankmem.offline import Run
from rankmem.offline.events import read_events
from rankmem.offline.report import event_field

_MARKERS = "o^sDv<>Px*"
_DPI = 100
NEAR = 3.0
"""A capacity up to this many times the panel's highest value is drawn on the panel (from 0)."""
MARKS_PER_RANK = 40
"""Phase markers per rank at most: on its highest steps, where which phase set the peak matters."""
MARK_GAP_PX = 9.0
"""Phase marks of one rank are at least this many pixels apart (a mark is ~5 px wide)."""
MIN_SPAN_GIB = 0.25
"""The smallest y range of a GiB panel: drift of a few MiB must not fill the panel's height."""


def default_keys(run: Run) -> list[str]:
    return [k for k in PLOT_KEYS if k in run.series]


def _shown(text: str) -> str:
    """A run's string as figure text: control characters escaped, and ``$`` too (matplotlib would
    parse what lies between two as mathtext, and refuse a figure whose key holds one)."""
    return printable(text).replace("$", r"\$")


def _label(key: str) -> str:
    return f"{key} (GiB)" if key.endswith("_gib") else key


def pyplot(feature: str = "rankmem plot") -> Any:
    """``matplotlib.pyplot`` on the Agg backend, imported: MissingExtraError when it is not installed,
    RankmemError naming the failure when it is but does not import (a broken install, a numpy it was
    not built for): finding the package is not enough."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingExtraError(feature, "plot", "matplotlib")
    plt, exc = load_optional(agg_pyplot)
    if exc is not None:  # whatever a broken install raises is one line
        raise RankmemError(f"{feature} needs matplotlib, which is installed but fails to import ({exc!r:.200}): "
                           "reinstall it (pip install --force-reinstall matplotlib)")
    return plt


def agg_pyplot() -> Any:
    """``matplotlib.pyplot`` imported on the Agg backend (no display needed), as ``rankmem plot`` uses it."""
    import matplotlib

    matplotlib.use("Agg")  # must precede pyplot's first import
    import matplotlib.pyplot as plt

    return plt


def plot_run(run: Run, output: str, keys: Sequence[str] | None = None, size: tuple[int,
                                                                                   int] | None = None) -> list[str]:
    """Write a PNG of ``keys`` (default: the catalogue's ``PLOT_KEYS`` present in the run); returns the keys drawn."""
    plt = pyplot()
    if run.steps.size == 0 and run.logged is not None and run.logged.steps.size:
        raise RankmemError(f"{run.path} has {run.logged.steps.size} logged steps but no per-rank values to plot "
                           f"({run.detail_note or 'its steps carry their aggregates only'}); "
                           "rankmem report reads the aggregates")
    if run.steps.size == 0:  # first: a log without steps has no keys either, and no key is the wrong hint
        raise RankmemError(
            f"{run.path} has no logged steps to plot: the run stopped, or its jsonl sink failed, before its first "
            "collect() was written; see the job's output for why, and plot a run log that has steps"
        )
    chosen = list(keys) if keys else default_keys(run)
    missing = [k for k in chosen if k not in run.series]
    if missing or not chosen:
        available = ", ".join(k for k in sorted(run.series) if not k.startswith(PHASE_PREFIX))
        raise RankmemError(f"no such key(s) in the run log: {', '.join(missing) or '(none chosen)'}; choose from: "
                           f"{available}")
    fig = draw_run(run, chosen, size)
    try:
        # No bbox_inches="tight": the PNG must be exactly the size asked for. Drawn in memory, then
        # written whole, and only onto a regular file or a new path.
        png = io.BytesIO()
        fig.savefig(png, dpi=_DPI, format="png")
        replace_file(output, png.getvalue())
    finally:
        plt.close(fig)
    return chosen


_NAMED_RANKS = 16
"""Ranks named in a panel's legend; past it, only the worst."""


def draw_run(run: Run, chosen: Sequence[str], size: tuple[int, int] | None = None) -> Any:
    """The matplotlib figure of :func:`plot_run` (the caller closes it)."""
    width, height = size or (1200, 360 * len(chosen))

    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(len(chosen), 1, figsize=(width / _DPI, height / _DPI), dpi=_DPI, sharex=True,
                             squeeze=False)
    phases = run.phases()
    # An event without a step (or with one no int64 holds: read as none) cannot be drawn at any x.
    events = [e for e in read_events(run.path).events if e.step is not None and e.kind != "anatomy"]
    caps = capacities(run.series, run.steps)
    for ax, key in zip(axes[:, 0], chosen, strict=True):
        _draw_key(ax, run, key, phases, events, for_key(caps, key), plt)
    axes[-1, 0].set_xlabel("step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


def _draw_key(ax: Any, run: Run, key: str, phases: Sequence[str], events: Sequence[Event],
              caps: Sequence[Capacity], plt: Any) -> None:
    """One panel: a line per rank (the worst thick), the phase that set each step's peak, capacity
    lines, events as red lines, and a y range that shows drift at its size."""
    steps = run.steps
    matrix = run.series[key]
    world = matrix.shape[1]
    low = worse(key) == "low"
    with np.errstate(invalid="ignore"), _quiet():
        worst_per_rank = np.nanmin(matrix, axis=0) if low else np.nanmax(matrix, axis=0)
    finite = np.isfinite(worst_per_rank)
    worst = int(np.nanargmin(worst_per_rank) if low else np.nanargmax(worst_per_rank)) if finite.any() else -1
    cmap = plt.get_cmap("tab10" if world <= 10 else "viridis")
    colors = [cmap(rank % 10 if world <= 10 else rank / max(world - 1, 1)) for rank in range(world)]
    for rank in range(world):
        # Past a legend's worth of ranks only the worst is named: 1,024 entries would bury the panel.
        named = world <= _NAMED_RANKS or rank == worst
        label = f"rank {rank}" + (" (worst)" if rank == worst else "") if named else None
        ax.plot(steps, matrix[:, rank], color=colors[rank], label=label, linewidth=2.2 if rank == worst else 1.0)
    _draw_every_step(ax, run, key, low)
    _draw_phase_peaks(ax, run, key, phases, colors)
    for n, e in enumerate(events):
        # A vertical line at each event's step, labelled once per kind and rank in the legend.
        ax.axvline(e.step, color="red", linestyle="--", linewidth=1.0, alpha=0.8,
                   label=_shown(f"{event_field(e.kind)} rank {event_field(e.shown('rank'))}") if n < 8 else None)
    unit = " GiB" if key.endswith("_gib") else ""
    _draw_capacity_and_range(ax, steps, matrix, caps, key.endswith("_gib"))
    if worst >= 0:
        ax.set_title(f"{_shown(key)}: worst rank {worst}, {'min' if low else 'peak'} {worst_per_rank[worst]:.3f}{unit}")
    ax.set_ylabel(_shown(_label(key)))
    ax.grid(True, alpha=0.3)
    # Outside the axes, to their right: inside, "best" still covers some rank's line somewhere.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize="small",
              ncol=2 if world > 8 else 1)


def _draw_every_step(ax: Any, run: Run, key: str, low: bool) -> None:
    """Where only some steps carry per-rank values (past the all-reduce crossover), the worst over ranks
    of every logged step, from its aggregates: the per-rank lines alone would miss the steps between."""
    if run.logged is None:
        return
    stat = "min" if low else "max"
    values = run.logged.metrics.get(f"{key}/{stat}")
    if values is not None and np.isfinite(values).any():
        ax.plot(run.logged.steps, values, color="black", linewidth=0.8, linestyle=":", zorder=1,
                label=f"{stat} over ranks, every step")


_NO_SINGLE = {"held": ("o", "no phase raised the step peak (held from before)"),
              "tie": ("X", "several phases rose to the step peak (tie)")}
"""Grey markers of the verdicts that name no single phase: the shape, the legend entry."""


def _draw_phase_peaks(ax: Any, run: Run, key: str, phases: Sequence[str], colors: Sequence[Any]) -> None:
    """A marker where memory rose to the rank's step peak in one phase (grey where none or several did),
    on that rank's highest :data:`MARKS_PER_RANK` steps: which phase made the spikes, per rank, without
    burying a long run."""
    suffix = PHASE_SUFFIX.get(key)
    if suffix is None:
        return
    steps, matrix = run.steps, run.series[key]
    phase_series = {k: m for k, m in run.series.items() if k.startswith(PHASE_PREFIX)}
    if not phase_series:
        return
    shapes = {p: _MARKERS[i % len(_MARKERS)] for i, p in enumerate(phases)}
    gap = _marker_gap_steps(ax, steps)
    hits: dict[str, list[tuple[int, int]]] = {}
    for rank in range(matrix.shape[1]):
        for row in _spaced_peaks(steps, matrix[:, rank], gap):
            if not np.isfinite(matrix[row, rank]):
                continue
            found = peak_phase(key, float(matrix[row, rank]), {k: float(m[row, rank]) for k, m in phase_series.items()})
            if found is not None and found.verdict != "outside":
                hits.setdefault(found.phases[0] if found.verdict == "rose" else found.verdict, []).append((row, rank))
    for what, cells in hits.items():
        rows, ranks = np.array([c[0] for c in cells]), np.array([c[1] for c in cells])
        if what in _NO_SINGLE:
            marker, label = _NO_SINGLE[what]
            ax.scatter(steps[rows], matrix[rows, ranks], marker=marker, s=30, facecolors="none",
                       edgecolors="dimgray", linewidths=1.0, zorder=3, label=label)
            continue
        marker = shapes.get(what, "o")
        for rank in sorted(set(ranks.tolist())):
            mine = rows[ranks == rank]
            # A dark edge: a marker in the rank's colour would vanish on the rank's own line.
            ax.scatter(steps[mine], matrix[mine, rank], marker=marker, s=22, color=colors[rank],
                       edgecolors="black", linewidths=0.5, zorder=3)
        # One legend entry per phase: its shape, hollow; filled, a mark takes the colour of its rank's line.
        ax.scatter([], [], marker=marker, s=22, facecolors="none", edgecolors="black", linewidths=0.8,
                   label=_shown(f"phase {what} raised the step peak (in the rank's colour)"))


def _marker_gap_steps(ax: Any, steps: np.ndarray) -> float:
    """How many steps :data:`MARK_GAP_PX` pixels span on ``ax``: marks closer than that merge into a bar."""
    if steps.size < 2:
        return 0.0
    fig = ax.figure
    width_px = float(fig.get_figwidth() * fig.dpi * ax.get_position().width) * 0.8  # the legend takes ~a fifth
    return float(steps[-1] - steps[0]) * MARK_GAP_PX / max(width_px, 1.0)


def _spaced_peaks(steps: np.ndarray, values: np.ndarray, gap: float) -> list[int]:
    """Indices of the highest values, at most :data:`MARKS_PER_RANK`, no two within ``gap`` steps: at
    400+ steps the marks stay apart and legible instead of piling into a solid bar."""
    order = np.argsort(-np.where(np.isfinite(values), values, -np.inf), kind="stable")
    chosen: list[int] = []
    for i in order:
        if len(chosen) == MARKS_PER_RANK or not np.isfinite(values[i]):
            break
        if all(abs(float(steps[i] - steps[j])) >= gap for j in chosen):
            chosen.append(int(i))
    return chosen


def _draw_capacity_and_range(ax: Any, steps: np.ndarray, matrix: np.ndarray, caps: Sequence[Capacity],
                             gib: bool) -> None:
    if not np.isfinite(matrix).any():
        return
    lo, hi = float(np.nanmin(matrix)), float(np.nanmax(matrix))
    top_cap = None
    for cap in caps:
        near = cap.value <= NEAR * max(hi, 1e-9)
        label = f"{cap.label} {cap.value:.3f} GiB" + ("" if near else f" (off the panel: peak is {hi / cap.value:.1%})")
        ax.plot(steps, cap.per_step, color="black", linestyle=(0, (6, 3)), linewidth=1.3, label=label, zorder=2)
        if near:
            top_cap = max(top_cap or 0.0, float(np.nanmax(cap.per_step)))
    if top_cap is not None:  # from 0 to just above the capacity: the gap is the room left
        ax.set_ylim(0, top_cap * 1.05)
        return
    floor = MIN_SPAN_GIB if gib else 0.0
    span = max(hi - lo, floor)
    mid = (hi + lo) / 2
    bottom = mid - span / 2
    if gib and bottom < 0 <= lo:  # memory is never negative: keep the floor's span above 0
        bottom = 0.0
    low, high = bottom - 0.05 * span, bottom + span * 1.05
    if not (math.isfinite(low) and math.isfinite(high)):  # values near float64's limit: matplotlib's choice
        return
    ax.set_ylim(low, high)
    if gib and hi - lo < floor:  # the panel is wider than the data: say how wide the data is
        ax.text(0.01, 0.97, f"data range {lo:.3f}..{hi:.3f} GiB ({(hi - lo) * 1024:.1f} MiB)",
                transform=ax.transAxes, fontsize="small", va="top", ha="left", color="dimgray",
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence numpy's all-NaN-slice warnings: a rank or a step without a value is normal here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield
