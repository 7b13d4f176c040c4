"""``rankmem plot``: one panel per key, one line per rank against step, drawn with matplotlib (Agg).

Phase peaks of the same quantity (``mem/phase/P/peak_*``) are drawn as markers, one marker shape per
phase, so a spike shows which phase made it. The worst rank (highest peak; lowest for headroom) is
drawn thicker and named in the legend. matplotlib is imported only here: ``pip install 'rankmem[plot]'``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from rankmem._catalogue import PHASE_PREFIX, PHASE_SUFFIX, PLOT_KEYS, phase_key, worse
from rankmem._events import read_events
from rankmem.errors import MissingExtraError, RankmemError
from rankmem.runlog import Run

_MARKERS = "o^sDv<>Px*"
_DPI = 100


def default_keys(run: Run) -> list[str]:
    return [k for k in PLOT_KEYS if k in run.series]


def _label(key: str) -> str:
    return f"{key} (GiB)" if key.endswith("_gib") else key


def plot_run(run: Run, output: str, keys: Sequence[str] | None = None, size: tuple[int, int] | None = None) -> list[str]:
    """Write a PNG of ``keys`` (default: the catalogue's ``PLOT_KEYS`` present in the run); returns the keys drawn."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingExtraError("rankmem plot", "plot", "matplotlib")
    if run.steps.size == 0:  # first: a log without steps has no keys either, and no key is the wrong hint
        raise RankmemError(
            f"{run.path} has no logged steps to plot: the run stopped, or its jsonl sink failed, before its first "
            "collect() was written; see the job's output for why, and plot a run log that has steps"
        )
    chosen = list(keys) if keys else default_keys(run)
    missing = [k for k in chosen if k not in run.series]
    if missing or not chosen:
        available = ", ".join(k for k in sorted(run.series) if not k.startswith(PHASE_PREFIX))
        raise RankmemError(f"no such key(s) in the run log: {', '.join(missing) or '(none chosen)'}; choose from: {available}")
    fig = draw_run(run, chosen, size)
    import matplotlib.pyplot as plt

    try:
        # No bbox_inches="tight": the PNG must be exactly the size asked for.
        fig.savefig(output, dpi=_DPI, format="png")
    finally:
        plt.close(fig)
    return chosen


def draw_run(run: Run, chosen: Sequence[str], size: tuple[int, int] | None = None) -> Any:
    """The matplotlib figure of :func:`plot_run` (the caller closes it)."""
    width, height = size or (1200, 360 * len(chosen))

    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot's first import
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(len(chosen), 1, figsize=(width / _DPI, height / _DPI), dpi=_DPI, sharex=True, squeeze=False)
    phases = run.phases()
    events = [e for e in read_events(run.path).events if isinstance(e.get("step"), int)]
    for ax, key in zip(axes[:, 0], chosen, strict=True):
        _draw_key(ax, run, key, phases, events, plt)
    axes[-1, 0].set_xlabel("step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


def _draw_key(ax: Any, run: Run, key: str, phases: Sequence[str], events: Sequence[dict[str, Any]], plt: Any) -> None:
    """One panel: a line per rank (the worst thick), phase peaks as markers, events as red lines."""
    steps = run.steps
    matrix = run.series[key]
    low = worse(key) == "low"
    with np.errstate(invalid="ignore"), _quiet():
        worst_per_rank = np.nanmin(matrix, axis=0) if low else np.nanmax(matrix, axis=0)
    finite = np.isfinite(worst_per_rank)
    worst = int(np.nanargmin(worst_per_rank) if low else np.nanargmax(worst_per_rank)) if finite.any() else -1
    colors = plt.get_cmap("tab10" if matrix.shape[1] <= 10 else "viridis")
    for rank in range(matrix.shape[1]):
        color = colors(rank % 10 if matrix.shape[1] <= 10 else rank / max(matrix.shape[1] - 1, 1))
        label = f"rank {rank}" + (" (worst)" if rank == worst else "")
        ax.plot(steps, matrix[:, rank], color=color, label=label, linewidth=2.2 if rank == worst else 1.0)
    suffix = PHASE_SUFFIX.get(key)
    for i, p in enumerate(phases):
        col = run.series.get(phase_key(p, suffix)) if suffix else None
        if col is None:
            continue
        # One marker per step at the ranks' max: shows which phase peaks where without clutter.
        with _quiet():
            peak = np.nanmax(col, axis=1)
        ax.scatter(steps, peak, marker=_MARKERS[i % len(_MARKERS)], s=14, color="black", alpha=0.6,
                   label=f"phase {p} peak (max over ranks)", zorder=3)
    for n, e in enumerate(events):
        # A vertical line at each event's step, labelled once per kind and rank in the legend.
        ax.axvline(e["step"], color="red", linestyle="--", linewidth=1.0, alpha=0.8,
                   label=f"{e.get('kind')} rank {e.get('rank')}" if n < 8 else None)
    if worst >= 0:
        ax.set_title(f"{key}: worst rank {worst}, {'min' if low else 'peak'} {worst_per_rank[worst]:.3f}"
                     + (" GiB" if key.endswith("_gib") else ""))
    ax.set_ylabel(_label(key))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small", ncol=2 if matrix.shape[1] > 4 else 1)

@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence numpy's all-NaN-slice warnings: a rank or a step without a value is normal here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield
