"""``rankmem report --html FILE``: the report as one self-contained HTML page.

One file that opens anywhere without a network: the tables as HTML tables, the style inline, and the
plots of :func:`rankmem.offline.plot.draw_run` embedded as PNG ``data:`` URIs. No script, no font, no
stylesheet and no image is fetched from anywhere (a test holds the file to that). PNG, not SVG: an
SVG carries the w3.org namespace URL, and matplotlib's PNG ``Software`` text chunk (which names its
web site) is left out.
"""

from __future__ import annotations

import base64
import contextlib
import html
import importlib.util
import io
import os
import tempfile
from collections.abc import Sequence

from rankmem.errors import RankmemError
from rankmem.offline import Run
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
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { padding: 0.2em 0.8em; border-bottom: 1px solid #ddd; }
th { text-align: left; border-bottom: 2px solid #888; }
td.right, th.right { text-align: right; font-variant-numeric: tabular-nums; }
ul.top li { margin: 0.15em 0; } li.event { color: #b00; font-weight: bold; } li.leak { color: #b00; }
img { max-width: 100%; border: 1px solid #ddd; }
""".strip()


def _table(columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]]) -> str:
    def cell(tag: str, text: str, justify: str) -> str:
        cls = ' class="right"' if justify == "right" else ""
        return f"<{tag}{cls}>{html.escape(text)}</{tag}>"

    head = "".join(cell("th", name, justify) for name, justify in columns)
    body = "\n".join("<tr>" + "".join(cell("td", v, j) for v, (_, j) in zip(row, columns, strict=True)) + "</tr>"
                     for row in rows)
    return f"<table>\n<tr>{head}</tr>\n{body}\n</table>"


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


def render_html(report: Report, run: Run) -> str:
    """The whole page as one string."""
    from rankmem.offline.plot import default_keys

    parts = [f"<h1>rankmem report: {html.escape(report.path)}</h1>",
             _list([*event_lines(report), *leak_lines(report), *worst_lines(report)], "top"),
             _list(summary_lines(report))]
    for title, (columns, rows) in (("Per key", key_table(report)), ("Per phase", phase_table(report))):
        if rows:
            parts += [f"<h2>{title}</h2>", _table(columns, rows)]
    verdicts = verdict_lines(report)
    if verdicts:
        parts += ["<h2>Headroom and growth</h2>", _list(verdicts)]
    keys = default_keys(run)
    if run.steps.size and keys:
        parts.append("<h2>Per rank against step</h2>")
        if importlib.util.find_spec("matplotlib") is None:
            parts.append("<p>The plots need matplotlib: pip install 'rankmem[plot]'</p>")
        else:
            try:
                data = base64.b64encode(plot_png(run, keys)).decode("ascii")
            except RankmemError as exc:  # matplotlib found but broken: the page says so, the rest stands
                parts.append(f"<p>{html.escape(str(exc))}</p>")
            else:
                alt = html.escape(", ".join(keys))
                parts.append(f'<img alt="{alt}" src="data:image/png;base64,{data}">')
    body = "\n".join(p for p in parts if p)
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f"<title>rankmem report: {html.escape(report.path)}</title>\n<style>\n{STYLE}\n</style>\n</head>\n"
            f"<body>\n{body}\n</body>\n</html>\n")


def write_html(report: Report, run: Run, path: str) -> None:
    """Write the page to ``path`` whole or not at all: to a temporary file beside it, renamed over it
    once written and flushed (a full disk left half a page behind). RankmemError when it cannot."""
    page = render_html(report, run).encode("utf-8")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise RankmemError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(page)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temp, 0o644)
        os.replace(temp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise RankmemError(f"cannot write {path}: {exc.strerror or exc}; {path} is as it was") from None
