"""What fills each phase's peak, offline: the worst rank's split beside the median rank's, and what to
change for the part that dominates (docs/anatomy.md). Over :class:`rankmem.offline.Run`'s arrays."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rankmem.core.catalogue import ANATOMY_PARTS, phase_key, phase_names
from rankmem.offline import Run

CHANGE = {
    "activations": "fewer tokens per micro-batch, or activation checkpointing",
    "optimizer": "shard the optimizer state (ZeRO-1 / FSDP) or offload it to the host",
    "params": "shard the parameters (FSDP / ZeRO-3) or keep them in a lower precision",
    "grads_high": "shard the gradients (ZeRO-2 / FSDP) or accumulate them in a lower precision",
    "other": "memory outside torch's allocator: see the device split by owner (NCCL, context, others)",
    "host other": "the process below the phase (interpreter, libraries, data, heap kept from before)",
    "slack": "allocator slack: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
}
"""What a user changes when a part fills most of the peak."""

SHOWN = ("params", "optimizer", "grads_high", "activations", "slack", "other")
"""The stacked parts, in order: the gradient range's high end is what the activations were computed with."""


@dataclass
class PhaseAnatomy:
    """One phase: at the step of its highest peak, that rank's split and the median rank's (GiB)."""

    phase: str
    step: int
    rank: int
    median_rank: int
    worst: dict[str, float]
    median: dict[str, float]
    dominant: str
    """The part the worst rank holds most of."""
    change: str


def _split(run: Run, phase: str, row: int, rank: int) -> dict[str, float]:
    found = ((part, run.series.get(phase_key(phase, f"anatomy/{part}_gib"))) for part in ANATOMY_PARTS)
    return {part: float(m[row, rank]) for part, m in found if m is not None and np.isfinite(m[row, rank])}


def anatomy_rows(run: Run) -> list[PhaseAnatomy]:
    """Per phase with anatomy keys: the step and rank of its highest split total (the peak), and the
    rank whose total is the median at that step."""
    rows = []
    for phase in run.phases():
        keys = [phase_key(phase, f"anatomy/{part}_gib") for part in SHOWN]
        parts = [run.series[k] for k in keys if k in run.series]
        if not parts:
            continue
        total = np.nansum(np.stack(parts), axis=0)  # steps x ranks
        total[~np.isfinite(parts[0])] = -np.inf
        if not np.isfinite(total).any():
            continue
        row, rank = divmod(int(total.argmax()), total.shape[1])
        order = np.argsort(total[row], kind="stable")
        median_rank = int(order[(len(order) - 1) // 2])
        worst = _split(run, phase, row, rank)
        dominant = max((p for p in SHOWN if p in worst), key=lambda p: worst[p])
        host = "slack" not in worst and dominant == "other"  # on the host, "other" is the resident rest
        rows.append(PhaseAnatomy(phase, int(run.steps[row]), rank, median_rank, worst,
                                 _split(run, phase, row, median_rank), dominant,
                                 CHANGE["host other" if host else dominant]))
    return rows


def _parts(split: dict[str, float], mib: bool) -> str:
    def f(part: str) -> str:
        value = split.get(part, 0.0)
        return f"{value * 1024:.1f}" if mib else f"{value:.2f}"

    grads = "grads " + (f("grads_high") if split.get("grads_low") == split.get("grads_high")
                        else f"{f('grads_low')}-{f('grads_high')}")
    named = [f"{p} {f(p)}" for p in ("params", "optimizer") if p in split]
    rest = [f"{p} {f(p)}" for p in ("activations", "slack", "other") if p in split]
    return ", ".join([*named, grads, *rest])


def anatomy_lines(rows: list[PhaseAnatomy]) -> list[str]:
    """The report's lines: per phase, the worst rank's split, the median rank's, what to change."""
    lines = []
    for a in rows:
        mib = sum(a.worst.get(p, 0.0) for p in SHOWN) < 1
        lines.append(f"what fills the {a.phase} peak ({'MiB' if mib else 'GiB'}, step {a.step}): rank {a.rank}: "
                     f"{_parts(a.worst, mib)}; median rank {a.median_rank}: {_parts(a.median, mib)}; most is "
                     f"{a.dominant.replace('_high', '')}: {a.change}")
    return lines


def compact_lines(ranks: Mapping[str, Sequence[float | None]]) -> list[str]:
    """``rankmem watch``'s lines: per phase, the rank whose split adds up highest, in one line."""
    lines = []
    for phase in phase_names(k for k in ranks if "/anatomy/" in k):
        split = {p: ranks.get(phase_key(phase, f"anatomy/{p}_gib"), []) for p in ANATOMY_PARTS}
        world = max(len(v) for v in split.values())
        totals = [sum(v[r] or 0.0 for p, v in split.items() if p in SHOWN and r < len(v))
                  for r in range(world)]
        rank = max(range(world), key=lambda r: totals[r])
        mine = {p: float(x) for p, v in split.items() if rank < len(v) and (x := v[rank]) is not None}
        mib = totals[rank] < 1
        lines.append(f"{phase} rank {rank} ({'MiB' if mib else 'GiB'}): {_parts(mine, mib)}")
    return lines


COLOURS = {"params": "#4e79a7", "optimizer": "#f28e2b", "grads_high": "#59a14f", "activations": "#e15759",
           "slack": "#bab0ac", "other": "#76b7b2"}


def html_bars(run: Run, rows: list[PhaseAnatomy]) -> str:
    """The HTML page's stacked bars: per phase, each rank's split at the step of the phase's highest peak,
    on one scale per phase (plain divs: the page fetches nothing)."""
    import html

    out = []
    for a in rows:
        row = int(np.flatnonzero(run.steps == a.step)[0])
        splits = [_split(run, a.phase, row, rank) for rank in range(run.world_size)]
        scale = max(sum(s.get(p, 0.0) for p in SHOWN) for s in splits) or 1.0
        out.append(f"<h3>{html.escape(a.phase)} (step {a.step})</h3>")
        for rank, s in enumerate(splits):
            bars = "".join(f'<span style="display:inline-block;height:1em;width:{100 * s[p] / scale:.2f}%;'
                           f'background:{COLOURS[p]}" title="{p.replace("_high", "")} {s[p]:.3f} GiB"></span>'
                           for p in SHOWN if s.get(p, 0.0) > 0)
            out.append(f'<div style="display:flex;align-items:center">'
                       f'<span style="width:6em">rank {rank}</span>'
                       f'<span style="flex:1;white-space:nowrap;overflow:hidden">{bars}</span></div>')
    legend = " ".join(f'<span style="color:{c}">&#9632;</span> {p.replace("_high", "")}'
                      for p, c in COLOURS.items())
    return "\n".join(out) + f"\n<p>{legend}</p>" if out else ""
