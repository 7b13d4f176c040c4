"""Which run a read command (report, plot, leaks, watch) reads when it is not told, or told a parent.

No RUN: the newest run directory under ``runs/`` (where ``rankmem train`` writes, ``runs/train`` by
default), said on stderr so the output is never silently about another run. A directory that holds no
run log but has runs below it is a parent: the command lists them, newest first, and exits 2.
"""

from __future__ import annotations

import os
import sys
import time

from rankmem.core.rundir import RUN_LOG_NAME
from rankmem.errors import RankmemError

RUNS_DIR = "runs"
DEPTH = 2
"""How deep below a parent runs are looked for (``runs/sweep/lr1e-3``)."""


def runs_under(parent: str, depth: int = DEPTH) -> list[tuple[str, float]]:
    """(run directory, its log's mtime) of every run at most ``depth`` levels below ``parent``, newest first."""
    found: list[tuple[str, float]] = []

    def visit(directory: str, left: int) -> None:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False) or entry.name.startswith("."):
                continue
            path = os.path.join(directory, entry.name)
            try:
                found.append((path, os.stat(os.path.join(path, RUN_LOG_NAME)).st_mtime))
            except OSError:
                if left > 1:
                    visit(path, left - 1)

    visit(parent, depth)
    return sorted(found, key=lambda pm: (-pm[1], pm[0]))


def listing(parent: str, runs: list[tuple[str, float]]) -> str:
    width = max(len(path) for path, _ in runs)
    rows = [f"  {path:<{width}}  {time.strftime('%Y-%m-%d %H:%M', time.localtime(mtime))}" for path, mtime in runs]
    many = f"{len(runs)} runs" if len(runs) != 1 else "1 run"
    return f"{parent} holds no run log; it holds {many}, newest first: pass one of them\n" + "\n".join(rows)


def resolve_run(run: str | None, command: str, waits: bool = False) -> str:
    """The run ``command`` reads: ``run`` itself, or the newest under ``runs/`` when it is None."""
    if run is None:
        runs = runs_under(RUNS_DIR)
        if not runs:
            raise RankmemError(f"no RUN given and no run under {RUNS_DIR}/ here: pass a run directory "
                               "(the --out of rankmem train, runs/train by default) or its rankmem.jsonl")
        run = runs[0][0]
        _say(command, f"no RUN given: reading {run}, the newest run under {RUNS_DIR}/")
        return run
    if os.path.isdir(run) and not os.path.exists(os.path.join(run, RUN_LOG_NAME)) \
            and not (waits and os.path.isdir(os.path.join(run, "heartbeat"))):
        runs = runs_under(run)
        if runs:
            raise RankmemError(listing(run, runs))
    return run


def _say(command: str, line: str) -> None:
    try:
        print(f"rankmem {command}: {line}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
