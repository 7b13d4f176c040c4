"""The training progress bar at a fixed width: M/N, elapsed, ETA and the rate survive 80 columns (the
metric text is cut first); plain lines number steps from 0, as the run log, summary and report do."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from rankmem.engine.progress import Progress, bar, plain_line

METRICS = ("reward 0.582 | pg_loss +1.234e-09 | dev peak 12.34 GiB (rank 3) | rss peak 2.51 GiB (rank 1) "
           "| and more text that a wide terminal would show")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _bar_line(width: int, done: int, total: int, seconds_per_step: float) -> str:
    console = Console(width=width, file=io.StringIO(), force_terminal=True, color_system=None)
    clock = Clock()
    progress = bar("grpo", console=console, get_time=clock, auto_refresh=False)
    task = progress.add_task("", total=total)
    progress.start_task(task)
    for _ in range(done):
        clock.now += seconds_per_step
        progress.update(task, advance=1, description=METRICS)
    lines = console.render_lines(progress.get_renderable(), console.options, pad=False)
    text = ["".join(s.text for s in line).rstrip() for line in lines]
    assert len(text) == 1, text  # one line: nothing folds
    return text[0]


@pytest.mark.parametrize("width", [80, 60])
def test_the_bar_keeps_count_elapsed_eta_and_rate_at_narrow_widths(width: int) -> None:
    line = _bar_line(width, done=12, total=40, seconds_per_step=2.0)
    assert len(line) <= width
    assert line.startswith("grpo ")
    for part in (" 12/40 ", " 0:00:24 ", " eta 0:00:56 ", " 2.0 s/it "):
        assert part in line, line
    assert "reward 0." in line and line.endswith("…"), line  # the metric text gives way, cut visibly


def test_the_bar_shows_the_whole_metric_text_where_there_is_room() -> None:
    line = _bar_line(250, done=30, total=40, seconds_per_step=0.25)
    assert " 30/40 0:00:07 eta 0:00:03 4.0 it/s " in line  # 7.5 s elapsed; 2.5 s to go, rounded up
    assert line.endswith(METRICS)


def test_plain_lines_number_steps_from_0_and_count_the_done(capsys: pytest.CaptureFixture[str]) -> None:
    assert plain_line(9, 40, 12.0, "reward 0.5") == "step 9 (10/40, 12 s, 1.2 s/it): reward 0.5"
    with Progress(True, 20, "sft", bar=False) as progress:  # stdout is captured, not a terminal
        for step in range(20):
            progress.advance(step, f"loss {step}")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"step {s}" for s in (0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 19)]
    assert lines[-1].startswith("step 19 (20/20, ") and lines[-1].endswith("): loss 19")


def test_progress_draws_on_the_console_it_is_given() -> None:
    out = io.StringIO()
    console = Console(width=80, file=out, force_terminal=True, color_system=None)
    with Progress(True, 5, "grpo", console=console) as progress:
        for step in range(5):
            progress.advance(step, "reward 0.1")
    assert "5/5" in out.getvalue() and "reward 0.1" in out.getvalue()
