"""``rankmem watch RUN``: a live per-rank view of a running job (memory, step, phase, events).

Redraws in place with ``rich.live`` every ``--interval`` seconds, in the normal screen (no alternate
screen, no mouse), so it works in any terminal and over ssh, and leaves the last frame in the
scrollback. Ctrl-C ends it with exit status 0. ``--once`` prints one frame and exits: for scripts;
``--json`` prints that frame as one JSON object. ``--wait`` waits for a run that does not exist yet
(the watch started before the job): it polls every ``--interval`` until the job's first heartbeat or
run-log line, saying once on stderr that it waits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING

from rankmem.cli._common import add_run_argument
from rankmem.cli._runs import resolve_run
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
    parser.add_argument("--wait", action="store_true",
                        help="wait for a run that has not started yet (no run log, no heartbeat) instead of failing")
    parser.add_argument("--json", action="store_true", help="with --once: print the frame as one JSON object")


def run(args: argparse.Namespace) -> int:
    from rankmem.offline.watch import Watcher

    if args.json and not args.once:
        raise RankmemError("--json prints one frame: use it with --once")
    args.run = resolve_run(args.run, "watch", waits=args.wait)
    if not os.path.exists(args.run) and args.once and not args.wait:
        raise RankmemError(f"no run at {args.run}: pass the --out directory of a running (or finished) job, "
                           "or --wait for one that has not started")
    watcher = Watcher(args.run)
    try:
        if args.wait:
            _wait(watcher, args.interval)
        if args.once:
            return _once(watcher, args)
        _live(watcher, args)
    except KeyboardInterrupt:  # Ctrl-C is how a live view ends: not an error, no traceback
        pass
    return 0


def _has_something(watcher: Watcher) -> bool:
    frame = watcher.frame()
    return frame.step is not None or bool(frame.rows)


def _wait(watcher: Watcher, interval: float) -> None:
    if _has_something(watcher):
        return
    print(f"rankmem watch: waiting for a job to write {watcher.run_dir} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    while not _has_something(watcher):
        time.sleep(interval)


def _once(watcher: Watcher, args: argparse.Namespace) -> int:
    from rankmem.offline.report import stdout_console
    from rankmem.offline.watchview import frame_json, render_frame

    frame = watcher.frame()
    if frame.step is None and not frame.rows:
        raise RankmemError(f"nothing to show in {watcher.run_dir} yet: no run log lines and no heartbeats "
                           f"(expected {watcher.log_path} and {os.path.join(watcher.run_dir, 'heartbeat')}); "
                           "--wait waits for them")
    if args.json:
        print(json.dumps(frame_json(frame, args.stale), indent=1))
    else:
        stdout_console(140).print(render_frame(frame, args.stale))
    return 0


def _live(watcher: Watcher, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.live import Live

    from rankmem.offline.report import stdout_console
    from rankmem.offline.watchview import render_frame

    if not sys.stdout.isatty():
        # A file or a pipe (`> file`, `| cat`): Live would draw only at its end, into a block buffer that a
        # SIGTERM loses. Each frame is printed whole and flushed instead.
        piped, shown = stdout_console(140), 0
        while True:
            piped.print(render_frame(watcher.frame(), args.stale))
            sys.stdout.flush()
            shown += 1
            if args.frames is not None and shown >= args.frames:
                return
            time.sleep(args.interval)
    console = Console(highlight=False)
    # auto_refresh=False: one redraw per poll, on this thread; nothing draws between polls.
    with Live(render_frame(watcher.frame(), args.stale), console=console, auto_refresh=False,
              redirect_stdout=False, redirect_stderr=False) as live:
        shown = 1
        while args.frames is None or shown < args.frames:
            time.sleep(args.interval)
            live.update(render_frame(watcher.frame(), args.stale), refresh=True)
            shown += 1
