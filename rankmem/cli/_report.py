"""``rankmem report RUN``: events, leaks and the worst rank first; then per key and per phase the worst
value with its step, rank and phase; capacity and headroom; ``--html FILE`` writes it as one page."""

from __future__ import annotations

import argparse
import json
import os

from rankmem.cli._common import add_leak_options, add_run_argument, check_output, leak_config, require_steps
from rankmem.cli._runs import resolve_run
from rankmem.core.rundir import RunDir
from rankmem.core.thresholds import FLOOR_GIB, FRACTION


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--html", default=None, metavar="FILE",
                        help="also write the report, with its plots, as one self-contained HTML file")
    add_leak_options(parser)
    group = parser.add_argument_group("imbalance", "a rank whose peak its tokens do not explain is flagged "
                                      "when the rest is over max(FRACTION x the phase's mean peak rise, FLOOR); "
                                      "one under that but clear of the noise is noted with its figure")
    group.add_argument("--imbalance-floor-mib", type=float, default=FLOOR_GIB * 1024, metavar="FLOOR",
                       help=f"the least unexplained excess flagged, MiB (default {FLOOR_GIB * 1024:g})")
    group.add_argument("--imbalance-fraction", type=float, default=FRACTION, metavar="FRACTION",
                       help=f"the share of the mean peak rise flagged (default {FRACTION:g})")


def run(args: argparse.Namespace) -> int:
    from rankmem.core.thresholds import ImbalanceConfig
    from rankmem.offline import read_run
    from rankmem.offline.report import build_report, render

    imbalance = ImbalanceConfig(floor_gib=args.imbalance_floor_mib / 1024, fraction=args.imbalance_fraction)
    if args.html:
        check_output(args.html, "--html")  # before the report is printed: a bad path fails first, alone
    the_run = read_run(resolve_run(args.run, "report"))
    if not os.path.isdir(RunDir.events_of(the_run.path)):
        require_steps(the_run, "report")  # a run that died before its first step may still have events
    report = build_report(the_run, leak_config(args), imbalance)
    if args.json:
        print(json.dumps(report.to_json(), indent=1, sort_keys=True))
    else:
        render(report)
    if args.html:
        from rankmem.offline.html import write_html

        write_html(report, the_run, args.html)
        if not args.json:  # stdout stays one JSON object with --json
            print(f"wrote {args.html}")
    return 0
