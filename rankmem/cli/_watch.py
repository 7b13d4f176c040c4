"""``rankmem watch RUN``: a live per-rank view of a running job (memory, step, phase, events).

Redraws in place with ``rich.live`` every ``--interval`` seconds, in the normal screen (no alternate
screen, no mouse), so it works in any terminal and over ssh, and leaves the last frame in the
scrollback. Ctrl-C ends it with exit status 0. ``--once`` prints one frame and exits: for scripts.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import TYPE_CHECKING

from rankmem.cli._common import add_run_argument
from rankmem.core.rundir import RunDir
from rankmem.errors import RankmemError

if TYPE_CHECKING:
    from rankmem.offline.watch import Watcher


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:  # `not >` also rejects NaN
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_argument(parser)
    parser.add_argument("--once", action="store_true", help="print one frame and exit (for scripts)")
    parser.add_argument("--interval", type=_positive, default=1.0, metavar="S",
                        help="seconds between redraws (default 1)")
    parser.add_argument("--frames", type=_count, default=None, metavar="N", help="stop after N redraws")
    parser.add_argument("--stale", type=_positive, default=30.0, metavar="S",
                        help="mark a rank whose last heartbeat is older than S seconds (default 30)")


def run(args: argparse.Namespace) -> int:
    from rankmem.offline.report import stdout_console
    from rankmem.offline.watch import Watcher, render_frame

    if not os.path.exists(args.run) and args.once:
        raise RankmemError(f"no run at {args.run}: pass the --out directory of a running (or finished) job")
    watcher = Watcher(args.run)
    if args.once:
        frame = watcher.frame()
        if frame.step is None and not frame.rows:
            raise RankmemError(f"nothing to show in {watcher.run_dir} yet: no run log lines and no heartbeats "
                               f"(expected {watcher.log_path} and {RunDir(watcher.run_dir).heartbeat})")
        stdout_console(140).print(render_frame(frame, args.stale))
        return 0
    try:
        _live(watcher, args)
    except KeyboardInterrupt:  # Ctrl-C is how a live view ends: not an error, no traceback
        pass
    return 0


def _live(watcher: Watcher, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.live import Live

    from rankmem.offline.watch import render_frame

    console = Console(highlight=False)
    # auto_refresh=False: one redraw per poll, on this thread; nothing draws between polls.
    with Live(render_frame(watcher.frame(), args.stale), console=console, auto_refresh=False,
              redirect_stdout=False, redirect_stderr=False) as live:
        shown = 1
        while args.frames is None or shown < args.frames:
            time.sleep(args.interval)
            live.update(render_frame(watcher.frame(), args.stale), refresh=True)
            shown += 1
