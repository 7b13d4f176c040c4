"""``rankmem report --html FILE``: the report as one self-contained HTML page.

A page, not the CLI text in HTML: a header card (the verdict: healthy, warnings or events; ranks,
hosts, duration, dates, the job, versions), the events first, the tables with their columns explained,
a plot per key family, and a width that follows the window (a grid of facts, tables that scroll
sideways on a phone). One file that opens anywhere without a network: the style inline, and the
plots of :func:`rankmem.offline.plot.draw_run` embedded as PNG ``data:`` URIs. No script, no font, no
stylesheet and no image is fetched from anywhere (a test holds the file to that). PNG, not SVG: an
SVG carries the w3.org namespace URL, and matplotlib's PNG ``Software`` text chunk (which names its
web site) is left out.
"""

from __future__ import annotations

import base64
import html
import importlib.util
import io
import math
from collections.abc import Sequence

from rankmem.core.rundir import replace_file
from rankmem.errors import RankmemError
from rankmem.offline import Run
from rankmem.offline.anatomy import html_bars
from rankmem.offline.report import (
    Report,
    event_lines,
    key_table,
    leak_lines,
    phase_table,
    summary_lines,
    verdict_lines,
    worst_lines,
)

STYLE = """
* { box-sizing: border-box; }
body { font-family: system-ui, sans-serif; margin: 0; color: #222; background: #f6f7f9; }
main { max-width: 1280px; margin: 0 auto; padding: 1.2em; }
h1 { font-size: 1.4em; margin: 0 0 0.4em; overflow-wrap: anywhere; } h2 { font-size: 1.1em; margin: 0 0 0.6em; }
section { background: #fff; border: 1px solid #e2e4e8; border-radius: 8px; padding: 1em 1.2em; margin: 0 0 1em; }
.facts { display: grid; grid-template-columns: repeat(auto-fill, minmax(14em, 1fr)); gap: 0.5em 1.5em;
  margin: 0.8em 0 0; }
.facts div { min-width: 0; } .facts dt { font-size: 0.8em; color: #666; }
.facts dd { margin: 0; overflow-wrap: anywhere; }
.verdict { display: inline-block; padding: 0.15em 0.7em; border-radius: 1em; font-weight: bold; color: #fff; }
.verdict.healthy { background: #2e7d32; } .verdict.warnings { background: #b26a00; }
.verdict.events { background: #b00020; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; font-size: 0.9em; width: 100%; }
th, td { padding: 0.25em 0.8em; border-bottom: 1px solid #e5e5e5; white-space: nowrap; }
th { text-align: left; border-bottom: 2px solid #888; } th[title] { text-decoration: underline dotted; cursor: help; }
td.right, th.right { text-align: right; font-variant-numeric: tabular-nums; }
ul { padding-left: 1.2em; } li { margin: 0.15em 0; } li.event { color: #b00020; font-weight: bold; }
li.leak { color: #b00020; }
dl.help { font-size: 0.85em; color: #444; } dl.help dt { font-weight: bold; } dl.help dd { margin: 0 0 0.3em 1em; }
figure { margin: 0 0 1em; } figcaption { font-size: 0.9em; color: #555; margin-bottom: 0.3em; }
img { width: 100%; height: auto; border: 1px solid #e2e4e8; }
""".strip()

COLUMN_HELP = {
    "worst": "the worst value over every rank and step: the max, or the min where low is the danger (headroom)",
    "worst GiB": "the phase's worst value of the key over every rank and step",
    "step": "the step (numbered from 0) that held the worst value",
    "rank": "the rank that held it",
    "phase": "the phase whose own peak was that step's peak on that rank",
    "max/mean": "the worst rank's value over the mean of the ranks at that step: 1.0 is balanced, 2.0 twice the "
                "average",
    "mean/step": "the phase's mean growth per step (a delta key) or mean value, over ranks and steps",
    "total (rank)": "the phase's growth summed over the run on its worst rank, and that rank",
    "unit": "GiB are 2**30 bytes",
}
"""What a column of the per-key and per-phase tables means: a tooltip on its heading and a list under
the table."""


def verdict(report: Report) -> str:
    """``events`` (an OOM, a near-OOM, a kill, a stall), ``warnings`` (a leak, a damaged log) or ``healthy``."""
    if report.events:
        return "events"
    if report.leaks or report.corrupt or report.truncated or report.corrupt_events:
        return "warnings"
    return "healthy"


def _utc(t: float | None) -> str:
    import datetime

    if t is None or not math.isfinite(t) or t <= 0:
        return "unknown"
    try:
        return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return "unknown"


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "unknown"
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def facts(report: Report, run: Run) -> list[tuple[str, str]]:
    """The header card's (label, value) pairs."""
    header = run.header
    times = run.logged.times if run.logged is not None and run.logged.times.size else run.times
    first = float(times[0]) if times.size else None
    last = float(times[-1]) if times.size else None
    started = header.started if header.started is not None else first
    job = header.config.get("run")
    shown = {k: v for k, v in job.items() if k in JOB_FIELDS} if isinstance(job, dict) else {}
    span = f" ({report.first_step}..{report.last_step})" if report.first_step is not None else ""
    steps = f"{report.steps} logged{span}"
    versions = ", ".join(f"{name} {version}" for name, version in (("rankmem", header.rankmem_version),
                                                                    ("torch",
                                                                     header.torch_version)) if version is not None)
    return [
        ("ranks", str(report.world_size)), ("hosts", ", ".join(report.hosts) or "unknown"), ("steps", steps),
        ("duration", _duration(last - started if last is not None and started is not None else None)),
        ("started", _utc(started)), ("last step logged", _utc(last)),
        ("job", " ".join(f"--{k.replace('_', '-')} {v}" for k, v in shown.items()) or "not recorded"),
        ("versions", versions or "not recorded"),
    ]


JOB_FIELDS = ("task", "engine", "steps", "nproc_per_node", "nnodes", "device", "micro_batch_size")
"""The fields of ``rankmem train``'s run config the card shows as the job."""


def _card(report: Report, run: Run) -> str:
    v = verdict(report)
    items = "".join(f"<div><dt>{html.escape(k)}</dt><dd>{html.escape(val)}</dd></div>" for k, val in facts(report, run))
    return (f'<section id="summary" class="card" data-verdict="{v}">\n'
            f"<h1>rankmem report: {html.escape(report.path)}</h1>\n"
            f'<span class="verdict {v}">{v}</span>\n<dl class="facts">{items}</dl>\n</section>')


def _section(ident: str, title: str, *body: str) -> str:
    inner = "\n".join(b for b in body if b)
    return f'<section id="{ident}">\n<h2>{html.escape(title)}</h2>\n{inner}\n</section>'


def _help(columns: Sequence[tuple[str, str]]) -> str:
    known = [(name, COLUMN_HELP[name]) for name, _ in columns if name in COLUMN_HELP]
    if not known:
        return ""
    items = "".join(f"<dt>{html.escape(n)}</dt><dd>{html.escape(h)}</dd>" for n, h in known)
    return f'<details><summary>What the columns mean</summary><dl class="help">{items}</dl></details>'


def _table(columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]]) -> str:
    def cell(tag: str, text: str, justify: str) -> str:
        cls = ' class="right"' if justify == "right" else ""
        tip = f' title="{html.escape(COLUMN_HELP[text])}"' if tag == "th" and text in COLUMN_HELP else ""
        return f"<{tag}{cls}{tip}>{html.escape(text)}</{tag}>"

    head = "".join(cell("th", name, justify) for name, justify in columns)
    body = "\n".join("<tr>" + "".join(cell("td", v, j) for v, (_, j) in zip(row, columns, strict=True)) + "</tr>"
                     for row in rows)
    return f'<div class="scroll"><table>\n<tr>{head}</tr>\n{body}\n</table></div>'


def _list(lines: Sequence[str], css: str = "") -> str:
    items = []
    for line in lines:
        cls = "event" if line.startswith("EVENT") else "leak" if line.startswith("LEAK") else ""
        items.append(f'<li class="{cls}">{html.escape(line)}</li>' if cls else f"<li>{html.escape(line)}</li>")
    return f'<ul class="{css}">\n' + "\n".join(items) + "\n</ul>" if items else ""


def plot_png(run: Run, keys: Sequence[str]) -> bytes:
    """The figure of :func:`rankmem.offline.plot.draw_run` for ``keys`` as PNG bytes, without the text chunk
    that names matplotlib's web site."""
    from rankmem.offline.plot import draw_run, pyplot

    plt = pyplot("rankmem report --html")
    fig = draw_run(run, keys)
    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    finally:
        plt.close(fig)
    return buf.getvalue()


def families(keys: Sequence[str]) -> dict[str, list[str]]:
    """Keys by family (``mem/host``, ``mem/device``, ...), in the order first seen: one plot each."""
    out: dict[str, list[str]] = {}
    for key in keys:
        out.setdefault(key.rsplit("/", 1)[0], []).append(key)
    return out


def _plots(run: Run) -> str:
    from rankmem.offline.plot import default_keys

    keys = default_keys(run)
    if not (run.steps.size and keys):
        return ""
    if importlib.util.find_spec("matplotlib") is None:
        return _section("plots", "Per rank against step",
                        "<p>The plots need matplotlib: pip install 'rankmem[plot]'</p>")
    figures = []
    for family, members in families(keys).items():
        try:
            data = base64.b64encode(plot_png(run, members)).decode("ascii")
        except RankmemError as exc:  # matplotlib found but broken: the page says so, the rest stands
            return _section("plots", "Per rank against step", f"<p>{html.escape(str(exc))}</p>")
        figures.append(f'<figure data-family="{html.escape(family)}"><figcaption>{html.escape(family)}: '
                       f'{html.escape(", ".join(members))}</figcaption>'
                       f'<img alt="{html.escape(", ".join(members))}" src="data:image/png;base64,{data}"></figure>')
    return _section("plots", "Per rank against step", *figures)


def render_html(report: Report, run: Run) -> str:
    """The whole page as one string: the card (verdict, ranks, hosts, duration, dates, job, versions),
    the events first, then leaks and the worst ranks, the tables with their column help, the headroom
    and growth verdicts, and a plot per key family."""
    events = event_lines(report)
    parts = [_card(report, run),
             _section("events", "Events", _list(events,
                                                "top") if events else "<p>No events: no OOM, near-OOM, kill or "
                                                                      "stall.</p>"),
             _section("findings", "Leaks and the worst ranks", _list([*leak_lines(report), *worst_lines(report)],
                                                                     "top"),
                      _list(summary_lines(report)))]
    for ident, title, (columns, rows) in (("keys", "Per key", key_table(report)),
                                          ("phases", "Per phase", phase_table(report))):
        if rows:
            parts.append(_section(ident, title, _table(columns, rows), _help(columns)))
    verdicts = verdict_lines(report)
    if verdicts:
        parts.append(_section("headroom", "Headroom and growth", _list(verdicts)))
    bars = html_bars(run, report.anatomy)
    if bars:
        parts.append(_section("anatomy", "What fills the peak (each rank, the phase's highest step)", bars))
    parts.append(_plots(run))
    body = "\n".join(p for p in parts if p)
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>rankmem report: {html.escape(report.path)}</title>\n<style>\n{STYLE}\n</style>\n</head>\n"
            f"<body>\n<main>\n{body}\n</main>\n</body>\n</html>\n")


def write_html(report: Report, run: Run, path: str) -> None:
    """Write the page to ``path`` whole or not at all (:func:`rankmem.core.rundir.replace_file`: a full disk
    left half a page behind, a rename replaced a device node). RankmemError when it cannot."""
    page = render_html(report, run).encode("utf-8")
    try:
        replace_file(path, page)
    except OSError as exc:
        raise RankmemError(f"cannot write {path}: {exc.strerror or exc}; {path} is as it was") from None
