"""``rankmem report RUN``: peaks per key with their step, rank and phase; headroom, growth, leaks."""

from __future__ import annotations

import argparse
import json
import os

from rankmem.cli._common import add_leak_options, add_run_argument, leak_config, require_steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_leak_options(parser)


def run(args: argparse.Namespace) -> int:
    from rankmem.report import build_report, render
    from rankmem.runlog import read_run

    the_run = read_run(args.run)
    if not os.path.isdir(os.path.join(os.path.dirname(the_run.path), "events")):
        require_steps(the_run, "report")  # a run that died before its first step may still have events
    report = build_report(the_run, leak_config(args))
    if args.json:
        print(json.dumps(report.to_json(), indent=1, sort_keys=True))
    else:
        render(report)
    return 0
