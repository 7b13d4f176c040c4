"""``rankmem plot RUN -o FILE.png``: per-rank memory against step, phase peaks marked, worst rank named."""

from __future__ import annotations

import argparse
import os

from rankmem.cli._common import add_run_argument
from rankmem.errors import RankmemError


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must be WIDTHxHEIGHT in pixels, like 1200x800; got {text!r}") from None
    if w < 100 or h < 100:
        raise argparse.ArgumentTypeError(f"size must be at least 100x100 pixels; got {text!r}")
    return w, h


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_argument(parser)
    parser.add_argument("-o", "--output", required=True, metavar="FILE.png", help="where to write the PNG")
    parser.add_argument("--keys", nargs="+", default=None, metavar="KEY",
                        help="per-rank keys to plot, one panel each (default: host rss, host peak rss, "
                             "device peak reserved when present)")
    parser.add_argument("--size", type=_size, default=None, metavar="WxH",
                        help="image size in pixels (default 1200 wide, 360 high per panel)")


def run(args: argparse.Namespace) -> int:
    from rankmem.plot import plot_run
    from rankmem.runlog import read_run

    the_run = read_run(args.run)
    try:
        keys = plot_run(the_run, args.output, keys=args.keys, size=args.size)
    except OSError as exc:  # a full disk, /dev/full, a read-only directory: one line, not a traceback
        if os.path.isfile(args.output):
            os.unlink(args.output)  # what was written of it is a broken PNG
        raise RankmemError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    print(f"wrote {args.output} ({', '.join(keys)})")
    return 0
