"""``rankmem leaks RUN``: per rank, is host RSS / device allocated / worker RSS still growing?

Exit status: 1 when a leak is found, 0 when none is, 2 on a user error (as every subcommand).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from rankmem.cli._common import add_leak_options, add_run_argument, check_keys, leak_config, require_steps
from rankmem.leaks import LEAK_KEYS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_argument(parser)
    parser.add_argument("--keys", nargs="+", default=list(LEAK_KEYS), metavar="KEY",
                        help="per-rank series to test (default: " + " ".join(LEAK_KEYS) + ")")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every rank's trend, not only leaks")
    parser.add_argument("--json", action="store_true", help="print the trends as JSON")
    add_leak_options(parser)


def run(args: argparse.Namespace) -> int:
    from rankmem.leaks import detect_leaks
    from rankmem.runlog import read_run

    the_run = read_run(args.run)
    require_steps(the_run, "leaks")
    config = leak_config(args)
    if args.keys != list(LEAK_KEYS):  # the defaults are each optional (a CPU run has no device keys)
        check_keys(the_run, args.keys)
    trends = detect_leaks(the_run, args.keys, config)
    leaks = [t for t in trends if t.leak]
    if args.json:
        print(json.dumps({"leaks": [asdict(t) for t in leaks], "trends": [asdict(t) for t in trends]}, indent=1))
        return 1 if leaks else 0
    if the_run.corrupt or the_run.truncated:
        print(f"skipped: {the_run.corrupt} corrupt line(s){', a truncated last line' if the_run.truncated else ''}")
    for t in trends if args.verbose else leaks:
        print(f"{'LEAK' if t.leak else 'ok  '} {t.describe()}")
    if leaks:
        ranks = sorted({t.rank for t in leaks})
        print(f"leak found on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}")
        return 1
    if not trends:
        print(f"no verdict: fewer than {leak_config(args).min_steps} logged steps in the window")
        return 0
    print(f"no leak found ({len(trends)} rank series checked)")
    return 0
