"""``rankmem plot RUN [-o FILE.png]``: per-rank memory against step, capacity drawn, the phase that set
each peak marked, the worst rank named. The PNG goes next to the run log unless ``-o`` says where."""

from __future__ import annotations

import argparse
import json
import os
import warnings

from rankmem.cli._common import add_json_option, add_run_argument, check_output, note_damage
from rankmem.cli._runs import resolve_run
from rankmem.core.text import printable
from rankmem.errors import RankmemError

DEFAULT_NAME = "rankmem.png"


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
    parser.add_argument("-o", "--output", default=None, metavar="FILE.png",
                        help="where to write the PNG (default: rankmem.png in the run directory)")
    parser.add_argument("--keys", nargs="+", default=None, metavar="KEY",
                        help="per-rank keys to plot, one panel each (default: host rss, host peak rss, "
                             "device peak reserved when present)")
    parser.add_argument("--size", type=_size, default=None, metavar="WxH",
                        help="image size in pixels (default 1200 wide, 360 high per panel)")
    add_json_option(parser, "the line saying what was written")


def run(args: argparse.Namespace) -> int:
    from rankmem.offline import read_run
    from rankmem.offline.plot import plot_run

    if args.output:
        check_output(args.output, "-o")  # before the run is read and drawn
    the_run = read_run(resolve_run(args.run, "plot"))
    note_damage(the_run, "plot")
    output = args.output or os.path.join(os.path.dirname(the_run.path), DEFAULT_NAME)
    try:
        with warnings.catch_warnings():
            # A value near float64's limit overflows matplotlib's arithmetic: the error below says so, once.
            warnings.filterwarnings("ignore", message="overflow encountered", category=RuntimeWarning)
            keys = plot_run(the_run, output, keys=args.keys, size=args.size)
    except RankmemError:
        raise  # a ValueError too, and already one line
    except OSError as exc:  # a full disk, /dev/full, a read-only directory: one line, not a traceback
        if os.path.isfile(output):
            os.unlink(output)  # what was written of it is a broken PNG
        raise RankmemError(f"cannot write {output}: {exc.strerror or exc}") from None
    except (ValueError, OverflowError) as exc:  # matplotlib's limits and ticks: a value near float64's maximum
        if os.path.isfile(output):
            os.unlink(output)
        raise RankmemError(f"cannot draw {the_run.path}: matplotlib refused the figure ({exc}); a value in it is "
                           "too large to plot (`rankmem report` lists the largest)") from None
    if args.json:
        print(json.dumps({"output": output, "keys": list(keys)}, indent=1))
    else:
        print(printable(f"wrote {output} ({', '.join(keys)})"))
    return 0
