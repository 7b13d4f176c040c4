"""``rankmem leaks RUN``: per rank, is host RSS / device allocated / worker RSS still growing?

Exit status: 1 when a leak is found, 0 when none is, 3 when there is no verdict (too few logged steps
in the window), 2 on a user error (as every subcommand).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from rankmem.cli._common import (
    add_leak_options,
    add_run_argument,
    check_keys,
    leak_config,
    note_damage,
    require_steps,
)
from rankmem.cli._runs import resolve_run
from rankmem.core.catalogue import LEAK_KEYS
from rankmem.core.text import printable

NO_VERDICT = 3
EPILOG = ("exit status: 1 a leak was found, 0 none was, 3 no verdict (fewer logged steps in the window than "
          "--min-steps asks), 2 bad input")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    add_run_argument(parser)
    parser.add_argument("--keys", nargs="+", default=list(LEAK_KEYS), metavar="KEY",
                        help="per-rank series to test (default: " + " ".join(LEAK_KEYS) + ")")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print every rank's trend, not only leaks, and why a clear trend was dismissed")
    parser.add_argument("--json", action="store_true", help="print the trends as JSON")
    add_leak_options(parser)


def run(args: argparse.Namespace) -> int:
    from rankmem.offline import read_run
    from rankmem.offline.leaks import detect_leaks, worst_first

    the_run = read_run(resolve_run(args.run, "leaks"))
    require_steps(the_run, "leaks")
    if args.json or the_run.detail_note or the_run.gaps:
        note_damage(the_run, "leaks")
    config = leak_config(args)
    if args.keys != list(LEAK_KEYS):  # the defaults are each optional (a CPU run has no device keys)
        check_keys(the_run, args.keys)
    trends = detect_leaks(the_run, args.keys, config)
    leaks = worst_first(trends)
    status = 1 if leaks else 0 if trends else NO_VERDICT
    if args.json:
        print(json.dumps({"leaks": [asdict(t) for t in leaks], "trends": [asdict(t) for t in trends]}, indent=1))
        return status
    if the_run.corrupt or the_run.truncated:
        print(f"skipped: {the_run.corrupt} corrupt line(s){', a truncated last line' if the_run.truncated else ''}")
    for t in trends if args.verbose else leaks:
        line = f"{'LEAK' if t.leak else 'ok  '} {t.describe()}"
        print(printable(f"{line}; not flagged: {t.reason}" if t.reason and not t.leak else line))
    if leaks:
        ranks = sorted({t.rank for t in leaks})
        worst = leaks[0]
        more = f"; worst: rank {worst.rank} {worst.key}" if len(leaks) > 1 else ""
        print(printable(f"leak found on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}{more}"))
    elif not trends:
        print(f"no verdict: fewer than {config.min_steps} logged steps in the window")
    else:
        print(f"no leak found ({len(trends)} rank series checked)")
    return status
