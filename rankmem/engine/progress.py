"""The logging rank's progress: a rich bar on a terminal, a plain line every tenth of the run otherwise.

Steps are numbered from 0 everywhere (the run log, the summary, ``rankmem report``, ``watch``); the bar's
M/N and the plain lines' ``(M/N)`` count the steps *done*, so step 9 finished is ``10/40``. At 80
columns the bar keeps M/N, the elapsed time, the ETA and the rate whole: the metric text is the
column that gives way (cut with an ellipsis), then the bar itself.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import rich.progress as rp
from rich.table import Column
from rich.text import Text

from rankmem.engine.output import say

__all__ = ["Progress", "RateColumn", "bar", "columns"]


class RateColumn(rp.ProgressColumn):
    """Steps per second, or seconds per step when slower than one a second (a training step often is)."""

    def render(self, task: rp.Task) -> Text:
        return Text(rate(task.speed), style="progress.data.speed")


def rate(speed: float | None) -> str:
    if not speed:
        return "?/s"
    return f"{speed:.1f} it/s" if speed >= 1 else f"{1 / speed:.1f} s/it"


def columns(task: str) -> list[Any]:
    """The bar's columns: all but the bar and the metric text have their own width and never fold."""
    return [
        rp.TextColumn(f"[bold]{task}", table_column=Column(no_wrap=True)),
        rp.BarColumn(bar_width=None, table_column=Column(ratio=1, no_wrap=True)),
        rp.MofNCompleteColumn(table_column=Column(no_wrap=True)),
        rp.TimeElapsedColumn(table_column=Column(no_wrap=True)),
        rp.TextColumn("eta", table_column=Column(no_wrap=True)),
        rp.TimeRemainingColumn(table_column=Column(no_wrap=True)),
        RateColumn(table_column=Column(min_width=9, no_wrap=True)),
        rp.TextColumn("{task.description}", table_column=Column(ratio=3, overflow="ellipsis", no_wrap=True)),
    ]


def bar(task: str, **kwargs: Any) -> rp.Progress:
    """The bar: expanded to the terminal's width, so the columns of fixed width get theirs first and the
    two ratio columns (bar, metric text) share what is left (rich shrinks every column alike otherwise)."""
    return rp.Progress(*columns(task), expand=True, **kwargs)


class Progress:
    """A rich progress bar on a terminal (unless ``bar`` is false), plain lines every tenth of the run
    otherwise; inert when ``enabled`` is false (every rank but the logging one)."""

    def __init__(self, enabled: bool, total: int, task: str, bar: bool = True, console: Any = None) -> None:
        self.enabled, self.total, self.task, self.bar = enabled, total, task, bar
        self._console = console
        self._bar: rp.Progress | None = None
        self._id: rp.TaskID | None = None
        self._started = time.monotonic()

    def __enter__(self) -> Progress:
        self._started = time.monotonic()
        if self.enabled and self.bar and (self._console is not None or sys.stdout.isatty()):
            self._bar = bar(self.task, console=self._console)
            self._bar.start()
            self._id = self._bar.add_task("", total=self.total)
        return self

    def advance(self, step: int, text: str) -> None:
        """Step ``step`` (from 0) is done; ``text``: its metrics."""
        if not self.enabled:
            return
        if self._bar is not None and self._id is not None:
            self._bar.update(self._id, completed=step + 1, description=text)
        elif step % max(1, self.total // 10) == 0 or step == self.total - 1:
            say(plain_line(step, self.total, time.monotonic() - self._started, text))

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


def plain_line(step: int, total: int, elapsed_s: float, text: str) -> str:
    """``step 9 (10/40, 12 s, 1.2 s/it): ...``: the step's own number, then the count done."""
    done = step + 1
    speed = rate(done / elapsed_s if elapsed_s > 0 else None)
    return f"step {step} ({done}/{total}, {elapsed_s:.0f} s, {speed}): {text}"
