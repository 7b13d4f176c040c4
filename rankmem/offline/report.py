"""``rankmem report``: what a run log says about each memory key, worst rank first.

The lines a user needs first come first: the forensic events (an OOM, a kill), then the leak verdicts
of :mod:`rankmem.offline.leaks`, then the worst rank of each headline key. Then, per key: the worst value over
the run (the peak, or the minimum for keys where low is bad, such as device headroom), the step and
rank that hold it, the phase that set it (when the run has phases), and the imbalance across ranks
(max over mean of the per-rank peaks); per phase (:mod:`rankmem.offline.phases`): its peak, what it leaves
behind, the worst rank and the per-step mean; capacity (:mod:`rankmem.fit.capacity`) and the headroom
left under each; host RSS growth. Everything is computed on the arrays of
:func:`rankmem.offline.read_run`, so a 100k-step log costs little more than reading it.
:mod:`rankmem.offline.html` writes the same as one self-contained page.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from rankmem.core.catalogue import (
    HEADLINE,
    PHASE_PREFIX,
    PHASE_SUFFIX,
    PeakPhase,
    is_freshness_key,
    is_memory_key,
    key_of,
    peak_phase,
    worst_stat,
)
from rankmem.core.events import Event, KilledEvent, NearOomEvent, OomEvent, StalledEvent
from rankmem.core.scalars import json_safe, to_float
from rankmem.core.text import printable
from rankmem.core.thresholds import ImbalanceConfig
from rankmem.fit.capacity import Assessment, Capacity, capacities
from rankmem.offline import Run
from rankmem.offline.advice import assess
from rankmem.offline.anatomy import PhaseAnatomy, anatomy_lines, anatomy_rows
from rankmem.offline.events import read_events
from rankmem.offline.holders import ANATOMY, holder_lines
from rankmem.offline.imbalance import (
    OverBudget,
    RankExcess,
    budget_overruns,
    imbalance_lines,
    rank_excess,
)
from rankmem.offline.leaks import LeakConfig, Trend, detect_leaks, worst_first
from rankmem.offline.phases import PhaseRow, phase_rows, worst_of


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
    """The phase in which memory rose to this step's peak on this rank; where none did (the peak was held
    from before) or several did, a parenthesised verdict that names no single phase
    (:attr:`rankmem.core.catalogue.PeakPhase.label`); ``None`` when not applicable."""
    imbalance: float | None
    """max over mean, across ranks, of each rank's peak over the run (1.0 = balanced)."""
    phase_verdict: str | None = None
    """``rose`` (``phase`` raised it), ``tie``, ``held`` or ``outside``; ``None`` when not applicable."""
    phases: list[str] = field(default_factory=list)
    """The phases the verdict is about: the one that rose, those tied, or those that only held it."""

    def attribute(self, found: PeakPhase | None) -> None:
        self.phase = None if found is None else found.label
        self.phase_verdict = None if found is None else found.verdict
        self.phases = [] if found is None else list(found.phases)


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
    events: list[Event] = field(default_factory=list)
    """Every rank's forensic events (``oom``, ``near_oom``, ``killed``, ``stalled``), by time."""
    corrupt_events: int = 0
    foreign_events: int = 0
    """Events of another run found beside this one (an earlier attempt's): counted, not shown."""
    events_skipped: list[str] = field(default_factory=list)
    """Event files not read (a FIFO, a device) or not whole (too large), each with why."""
    phases: list[PhaseRow] = field(default_factory=list)
    """Per phase and key: the worst value, its step and rank, the per-step mean, a delta's total."""
    detail_steps: int | None = None
    """Logged steps that carry per-rank values, when not all do (past the all-reduce crossover, or the
    last second before a crash); per-key worst values then come from every step's aggregates."""
    detail_note: str | None = None
    """Why per-rank values are missing beyond that (a damaged or missing side file)."""
    gaps: list[str] = field(default_factory=list)
    """Collects the run log says it dropped, one line each."""
    holders: list[str] = field(default_factory=list)
    """What held the peak, from the replays of sampled windows and OOMs (:mod:`rankmem.offline.holders`)."""
    limits: list[Capacity] = field(default_factory=list)
    """Device total, node total, cgroup limit, where measured, with the least room left under each."""
    advice: Assessment | None = None
    """The limit per rank and each phase's verdict, as ``advise`` and the online warning reach them."""
    peak_rss_scope: str | None = None
    """How the ranks' per-window host peaks were taken (the header's ``peak_rss_scope``): ``window``
    (reset per window), ``edges`` (``peak_source="edges"``: never reset), ``lifetime``, ``sampled``;
    several joined by ``/`` where ranks differ; None for a log that does not say."""
    imbalance: list[RankExcess] = field(default_factory=list)
    """Per phase told its micro-batches and rank: the excess peak, what its tokens explain, the rest."""
    overruns: list[OverBudget] = field(default_factory=list)
    """Per phase with a configured token budget: the windows whose heaviest micro-batch went over it."""
    anatomy: list[PhaseAnatomy] = field(default_factory=list)
    """Per phase with ``Monitor.track``: what fills its peak on the worst rank and the median rank."""

    def worst(self) -> list[tuple[str, KeyReport]]:
        """(headline label, report) of the catalogue's headline keys present: who is closest to trouble."""
        by_key = {k.key: k for k in self.keys}
        # A peak of 0 everywhere (no dataloader workers) has no worst rank worth a line.
        return [(label, by_key[s.key]) for label, s in HEADLINE
                if s.key in by_key and not (by_key[s.key].worst == "max" and by_key[s.key].value == 0)]

    @property
    def leaks(self) -> list[Trend]:
        """The leaking series, worst first: the soonest to exhaust its memory, then the fastest growing."""
        return worst_first(self.trends)

    def to_json(self) -> dict[str, Any]:
        out = asdict(replace(self, limits=[], advice=None))  # neither copies a run's arrays: said below
        out["events"] = [e.to_json() for e in self.events]  # each as its line holds it
        out["leaks"] = [asdict(t) for t in self.leaks]
        out["worst"] = [{"label": label, **asdict(k)} for label, k in self.worst()]
        if self.host_growth is not None:
            out["host_growth"]["growth"] = self.host_growth.growth
        out["limits"] = [c.to_json() for c in self.limits]
        out["advice"] = self.advice.to_json() if self.advice is not None else None
        cleaned: dict[str, Any] = json_safe(out)
        return cleaned


def memory_keys(run: Run) -> list[str]:
    """The run's per-rank memory keys, phase keys aside, sorted (with those only aggregates name)."""
    keys = set(run.series)
    if run.logged is not None:
        keys.update(k[: -len("/max")] for k in run.logged.metrics if k.endswith("/max"))
    return sorted(k for k in keys if is_memory_key(k))


def _phase_of(run: Run, key: str, row: int, rank: int, value: float) -> PeakPhase | None:
    if key not in PHASE_SUFFIX:
        return None
    rank_values = {k: float(m[row, rank]) for k, m in run.series.items() if k.startswith(PHASE_PREFIX)}
    return peak_phase(key, value, rank_values)


def _worst_logged(run: Run, key: str, low: bool) -> tuple[float, int, int] | None:
    """(value, step, rank) of ``key``'s worst aggregate over every logged step (``K/min`` with
    ``K/min_rank`` where low is bad); None when the run has no such aggregates."""
    if run.logged is None:
        return None
    stat = "min" if low else "max"
    values, ranks = run.logged.metrics.get(f"{key}/{stat}"), run.logged.metrics.get(f"{key}/{stat}_rank")
    if values is None or ranks is None or not np.isfinite(values).any():
        return None
    filled = np.where(np.isfinite(values), values, np.inf if low else -np.inf)
    at = int(filled.argmin() if low else filled.argmax())
    rank = float(ranks[at])  # a line is untrusted: a rank outside the world (a flipped digit) is unknown, -1
    known = 0 <= rank < run.world_size and rank.is_integer()
    return float(values[at]), int(run.logged.steps[at]), int(rank) if known else -1


def key_report(run: Run, key: str) -> KeyReport | None:
    """The worst value of ``key`` with its step, rank, phase and imbalance; None if never present.

    Where only some steps carry per-rank values (:attr:`Run.logged`), the worst value, its step and rank
    come from every step's aggregates (``K/max`` and ``K/max_rank``); the imbalance and the phase from
    the steps with per-rank values."""
    matrix = run.series.get(key, np.empty((0, 0)))
    worst = worst_stat(key)
    logged = _worst_logged(run, key, worst == "min")
    if matrix.size == 0 or not np.isfinite(matrix).any():
        if logged is None:
            return None
        return KeyReport(key=key, worst=worst, value=logged[0], step=logged[1], rank=logged[2], phase=None,
                         imbalance=None)
    report = _key_report_detail(run, key, matrix, worst)
    if logged is not None and (logged[0] < report.value if worst == "min" else logged[0] > report.value):
        report.value, report.step, report.rank = logged[0], logged[1], logged[2]
        report.attribute(None)
    return report


def _key_report_detail(run: Run, key: str, matrix: np.ndarray, worst: str) -> KeyReport:
    low = worst == "min"
    filled, flat = worst_of(matrix, low)
    row, rank = divmod(flat, matrix.shape[1])
    value = float(matrix[row, rank])
    imbalance = None
    if not low:
        per_rank = filled.max(axis=0)  # -inf for a rank with no finite value: dropped below
        per_rank = per_rank[np.isfinite(per_rank)]
        mean = float(per_rank.mean()) if per_rank.size else math.nan
        imbalance = float(per_rank.max()) / mean if per_rank.size and mean > 0 else None
    report = KeyReport(key=key, worst=worst, value=value, step=int(run.steps[row]), rank=rank, phase=None,
                       imbalance=imbalance)
    report.attribute(_phase_of(run, key, row, rank, value))
    return report


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


def build_report(run: Run, leak_config: LeakConfig | None = None,
                 imbalance_config: ImbalanceConfig | None = None) -> Report:
    # The leak verdicts are the longest part on a long run (medians over every rank's series) and share
    # nothing with the tables: they run on a second thread meanwhile (numpy drops the GIL in them).
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rankmem-leaks") as pool:
        trends = pool.submit(detect_leaks, run, config=leak_config)
        report = _tables(run, imbalance_config or ImbalanceConfig())
        report.trends = trends.result()
    return report


def _tables(run: Run, imb: ImbalanceConfig) -> Report:
    events = read_events(run.path, run.header.run_id)
    steps = run.steps if run.logged is None else run.logged.steps
    report = Report(
        path=run.path,
        world_size=run.world_size,
        hosts=sorted({r.host or "?" for r in run.header.ranks}),
        steps=int(steps.size),
        first_step=int(steps[0]) if steps.size else None,
        last_step=int(steps[-1]) if steps.size else None,
        corrupt=run.corrupt,
        truncated=run.truncated,
        events=[e for e in events.events if e.kind != ANATOMY],  # replays, not failures: in holders
        holders=holder_lines(events.events),
        corrupt_events=events.corrupt,
        foreign_events=events.foreign,
        events_skipped=events.skipped,
        detail_steps=int(run.steps.size) if run.logged is not None else None,
        detail_note=run.detail_note,
        gaps=[str(g) for g in run.gaps],
        peak_rss_scope="/".join(sorted({r.peak_rss_scope for r in run.header.ranks if r.peak_rss_scope})) or None,
    )
    for key in memory_keys(run):
        kr = key_report(run, key)
        if kr is not None:
            report.keys.append(kr)
            if key == key_of("headroom"):
                report.headroom = kr
    report.host_growth = growth(run, key_of("rss"))
    report.phases = phase_rows(run)
    report.anatomy = anatomy_rows(run)
    report.limits = capacities(run.series, run.steps)
    report.advice = assess(run)
    if run.logged is None:  # the split needs every step's per-rank values
        report.imbalance = rank_excess(run, floor_gib=imb.floor_gib, fraction=imb.fraction)
        report.overruns = budget_overruns(run)
    return report


def _fmt(value: float, key: str) -> str:
    return f"{value:.3f}" if key.endswith(("_gib", "_s")) else f"{value:g}"


def _unit(key: str) -> str:
    return "GiB" if key.endswith("_gib") else "s" if key.endswith("_s") else ""


def stdout_console(width: int) -> Any:
    """A rich Console on stdout, ``width`` columns off a terminal (piped output and tests stay stable).
    A reader that leaves (``| head -1``) raises BrokenPipeError to the CLI, which exits quietly with the
    command's status, instead of rich's own ``SystemExit(1)``."""
    import sys

    from rich.console import Console

    class _PipedConsole(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError

    return _PipedConsole(file=sys.stdout, width=None if sys.stdout.isatty() else width, highlight=False)


def render(report: Report) -> None:
    """Print the report with rich: a summary, one table row per key, then headroom, growth and leaks."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    console = stdout_console(120)
    # What happened, whether anything leaks, and who is worst come first: they are why it is opened.
    # Every string is the run log's (keys, phases, messages): Text of printable(), never markup.
    for line in [*event_lines(report), *leak_lines(report), *worst_lines(report), *summary_lines(report)]:
        console.print(Text(printable(line)), soft_wrap=True)  # an event or a verdict is one line, whatever its length
    for title, (columns, rows) in (("", key_table(report)), ("per phase", phase_table(report))):
        if not rows:
            continue
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, title=title or None,
                      title_justify="left")
        for name, justify in columns:
            table.add_column(name, justify=justify)  # type: ignore[arg-type]
        for row in rows:
            table.add_row(*(Text(printable(cell)) for cell in row))
        console.print()
        console.print(table)
    console.print()
    for line in verdict_lines(report):
        console.print(Text(printable(line)), soft_wrap=True)  # a leak's verdict is one line, whatever its length


Columns = list[tuple[str, str]]


def key_table(report: Report) -> tuple[Columns, list[list[str]]]:
    """(name, justify) columns and rows of the per-key table, for the terminal and the HTML page."""
    columns = [("key", "left"), ("worst", "right"), ("unit", "left"), ("step", "right"), ("rank", "right"),
               ("phase", "left"), ("max/mean", "right")]
    rows = [[k.key, f"{k.worst} {_fmt(k.value, k.key)}", _unit(k.key), str(k.step), str(k.rank) if k.rank >= 0 else "?",
             k.phase or "", f"{k.imbalance:.2f}" if k.imbalance is not None else ""]
            for k in report.keys if not is_freshness_key(k.key)]
    return columns, rows


def phase_table(report: Report) -> tuple[Columns, list[list[str]]]:
    """The per-phase table: a phase's peak and what it leaves behind (``*_delta``), each with the worst
    rank and step, the mean per step, and for a delta its largest per-rank total over the run."""
    columns = [("phase", "left"), ("key", "left"), ("worst GiB", "right"), ("step", "right"), ("rank", "right"),
               ("mean/step", "right"), ("total (rank)", "right")]
    rows = []
    for p in report.phases:
        signed = p.total is not None  # a delta: its sign says grown or given back
        fmt = "+.3f" if signed else ".3f"
        total = f"{p.total:+.3f} ({p.total_rank})" if p.total is not None else ""
        rows.append([p.phase, p.key, f"{p.worst:{fmt}}", str(p.step), str(p.rank), f"{p.mean_per_step:{fmt}}", total])
    return columns, rows


def event_lines(report: Report) -> list[str]:
    """One line per event: ``EVENT oom rank 1 step 3 phase update: host MemoryError ...``."""
    lines = [f"EVENT {describe_event(e)}" for e in report.events]
    if report.corrupt_events:
        lines.append(f"events: {report.corrupt_events} torn or corrupt line(s) skipped")
    if report.foreign_events:
        lines.append(f"events: {report.foreign_events} event(s) of another run (its run id differs from this "
                     "log's) not shown")
    lines += [f"events: {why}" for why in report.events_skipped]
    return lines + [f"held: {line}" for line in report.holders]


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


_FIELD_CHARS = 200
"""Characters of one event field shown at most (an OOM message is a line; a field can be megabytes)."""


def event_field(value: Any) -> str:
    """An event field as text: another process wrote it, so any type, any size (a 4,000-digit integer,
    a list nested 900 deep: shown by type) is one short string."""
    if isinstance(value, bool) or value is None or isinstance(value, float):
        text = str(value)
    elif isinstance(value, int):
        text = str(value) if abs(value) < 10**30 else f"(an integer of {len(str(abs(value)))} digits)"
    elif isinstance(value, str):
        text = value
    else:
        text = f"({type(value).__name__})"
    return text if len(text) <= _FIELD_CHARS else text[:_FIELD_CHARS] + f"... ({len(text)} characters)"


def _gib(value: Any) -> str | None:
    number = to_float(value)
    return None if number is None or not math.isfinite(number) else f"{number / 2**30:.3f}"


def describe_event(e: Event) -> str:
    """One line for an event. The record's fields are typed; a field that was not of its type shows what
    the line held (:meth:`~rankmem.core.events.Event.shown`), bounded by :func:`event_field`, and
    the nested tables are checked entry by entry (another process wrote them)."""
    where = (f"{event_field(e.kind)} rank {event_field(e.shown('rank'))} step {event_field(e.shown('step'))} "
             f"phase {event_field(e.shown('phase') or '-')}")
    if isinstance(e, OomEvent):
        site = event_field(e.shown("where") if e.where == "unknown" else e.where)
        what = f"{site} {event_field(e.shown('error') or '')}".strip()
        if (requested := _gib(e.requested_bytes)) is not None:
            what += f"; requested {requested} GiB"
        device = _mapping(e.device)
        free, total = _gib(device.get("free_bytes")), _gib(device.get("total_bytes"))
        if free is not None and total is not None:
            what += f"; device free {free} of {total} GiB"
        if (rss_text := _gib(_mapping(e.host).get("rss_bytes"))) is not None:
            what += f"; RSS {rss_text} GiB"
        return f"{where}: {what}{owners_text(device.get('attribution'))}"
    if isinstance(e, NearOomEvent):
        shown = [event_field(r) for r in e.reasons[:8]]
        return f"{where}: {', '.join(shown) or 'low headroom'}{owners_text(_mapping(e.device).get('attribution'))}"
    if isinstance(e, KilledEvent):
        return (f"{where}: killed by {event_field(e.shown('signal'))}{_last_rss(e.last_rss_bytes)}; "
                f"cause {event_field(e.shown('cause'))}")
    if isinstance(e, StalledEvent):
        age = e.heartbeat_age_s
        age_text = f"{age:.0f} s" if age is not None else "?"
        return (f"{where}: no heartbeat for {age_text}{_last_rss(e.last_rss_bytes)}; "
                f"process state {event_field(e.shown('process_state'))}")
    return where


def _last_rss(value: int | None) -> str:
    rss = _gib(value)
    return f", last RSS {rss} GiB" if rss is not None else ""


OWNER_PARTS = ("reserved", "nontorch", "siblings", "descendants", "foreign", "unattributed")


def owners_text(table: Any) -> str:
    """``; device by owner (GiB): reserved 1.000, nontorch 0.400, ... foreign ? (why)``: an event's
    ``device.attribution`` table (docs/device-attribution.md); "" without one. Unknown is ``?``, never 0."""
    if not isinstance(table, Mapping):
        return ""
    reasons = _mapping(table.get("reasons"))
    parts = []
    for part in OWNER_PARTS:
        value = table.get(f"{part}_bytes")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(f"{part} {value / 2**30:.3f}")
        else:
            parts.append(f"{part} ?")
    why = sorted({str(r) for r in reasons.values()})
    return f"; device by owner (GiB): {', '.join(parts)}" + (f" (unknown: {'; '.join(why)})" if why else "")


def worst_lines(report: Report) -> list[str]:
    """The worst rank of each headline key, one line each: ``worst peak_rss: rank 2, max 4.500 GiB at
    step 7 (phase update)``."""
    lines = []
    for label, k in report.worst():
        unit = f" {_unit(k.key)}" if _unit(k.key) else ""
        phase = "" if not k.phase else f" (phase {k.phase})" if k.phase_verdict == "rose" else f" {k.phase}"
        rank, value = k.rank if k.rank >= 0 else "?", f"{k.worst} {_fmt(k.value, k.key)}{unit}"  # -1: the lines'
        lines.append(f"worst {label}: rank {rank}, {value} at step {k.step}{phase}")
    return lines


def limit_lines(report: Report) -> list[str]:
    lines = []
    if report.limits:
        lines.append("capacity: " + ", ".join(f"{lim.label} {lim.value:.3f} GiB" for lim in report.limits))
    return lines + (report.advice.lines() if report.advice is not None else [])


def summary_lines(report: Report) -> list[str]:
    lines = [f"run log: {report.path}"]
    span = f"steps {report.first_step}..{report.last_step}" if report.steps else "no steps"
    hosts = f"{len(report.hosts)} host{'s' if len(report.hosts) != 1 else ''}"
    lines.append(f"{report.world_size} ranks on {hosts}, {report.steps} logged steps ({span})")
    if report.detail_steps is not None:
        lines.append(f"per-rank values on {report.detail_steps} of the {report.steps} steps (the others logged "
                     "their aggregates: max, min, mean and the ranks holding them); worst values from all steps")
    if report.detail_note:
        lines.append(f"note: {report.detail_note}")
    lines += [f"gap: {g}" for g in report.gaps]
    note = PEAK_SCOPE_NOTES.get(report.peak_rss_scope or "window")
    if note:
        lines.append(f"peak RSS per window: {note}")
    if report.corrupt or report.truncated:
        lines.append(
            f"skipped: {report.corrupt} corrupt line{'s' if report.corrupt != 1 else ''}, "
            f"{'a truncated last line' if report.truncated else 'no truncated last line'}"
        )
    return lines + limit_lines(report)


PEAK_SCOPE_NOTES = {
    "edges": "sampled at window edges (peak_source='edges', VmHWM never reset): exact where a window set a new "
             "lifetime high, else the max RSS at its edges; lifetime peaks are exact",
    "lifetime": "lifetime peaks (the kernel could not reset VmHWM): a window's peak is the process's so far",
    "sampled": "sampled at window edges (no resettable high-water mark on this platform)",
}
"""The line the report prints where per-window host peaks are not exact (``window`` needs none)."""


HEADROOM_LABELS = {"node total": "node available", "cgroup limit": "cgroup headroom (limit - used)"}


def verdict_lines(report: Report) -> list[str]:
    """Headroom under each capacity and host RSS growth (the leak verdicts are among the top lines)."""
    lines = []
    if report.headroom is not None:
        h = report.headroom
        lines.append(f"device headroom: min {h.value:.3f} GiB at step {h.step} on rank {h.rank}")
    for lim in report.limits:
        least = lim.least_room()
        if lim.label in HEADROOM_LABELS and least is not None:
            lines.append(f"{HEADROOM_LABELS[lim.label]}: min {least[0]:.3f} GiB at step {least[1]} on rank "
                         f"{least[2]} (of {lim.value:.3f} GiB)")
    lines += [f"figures' age ({k.key}): {k.worst} {_fmt(k.value, k.key)} {_unit(k.key)} at step {k.step} "
              f"on rank {k.rank if k.rank >= 0 else '?'}" for k in report.keys if is_freshness_key(k.key)]
    if report.host_growth is not None:
        g = report.host_growth
        lines.append(
            f"host RSS growth (first to last step): {g.growth * 1024:+.1f} MiB on rank {g.rank} "
            f"(mean over ranks {g.mean_growth * 1024:+.1f} MiB)"
        )
    return lines + imbalance_lines(report.imbalance, report.overruns) + anatomy_lines(report.anatomy)


def leak_lines(report: Report) -> list[str]:
    lines = []
    leaks = report.leaks
    if leaks:
        lines += [f"LEAK {t.describe()}" for t in leaks]
    elif report.trends:
        lines.append(f"leaks: none found ({len(report.trends)} rank series checked)")
        # The growth line names a rank: say why its growth is no leak, where its series grew clearly.
        g = report.host_growth
        lines += [f"  rank {t.rank} host RSS not flagged: {t.reason}" for t in report.trends
                  if g is not None and t.rank == g.rank and t.key == key_of("rss") and t.reason]
    else:
        lines.append("leaks: not checked (too few steps)")
    return lines
