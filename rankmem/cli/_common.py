"""What the offline subcommands share: the run argument, the leak options and their checks, the
no-steps check, the check of an output path before any work."""

from __future__ import annotations

import argparse
import math
import os
import stat
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rankmem.core.rundir import kind_of
from rankmem.core.text import printable
from rankmem.core.thresholds import LeakConfig
from rankmem.errors import RankmemError

if TYPE_CHECKING:
    from rankmem.offline import Run


def add_run_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", nargs="?", default=None,
                        help="a run directory (holding rankmem.jsonl) or the .jsonl file (default: the newest run "
                             "under runs/; a directory of runs lists them)")


def add_json_option(parser: argparse.ArgumentParser, what: str = "the table") -> None:
    parser.add_argument("--json", action="store_true", help=f"print one JSON object instead of {what}")


def check_output(path: str, flag: str) -> None:
    """Refuse an output ``path`` that cannot be written, before any work: its directory must exist and be
    writable, and the path must not be a directory."""
    directory = os.path.dirname(path) or "."
    if os.path.isdir(path):
        raise RankmemError(f"{flag} {path}: is a directory; name a file in it")
    if not os.path.isdir(directory):
        raise RankmemError(f"{flag} {path}: no such directory: {directory}")
    if not os.access(directory, os.W_OK):
        raise RankmemError(f"{flag} {path}: cannot write in {directory} (permission denied)")
    if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
        raise RankmemError(f"{flag} {path}: is {kind_of(os.lstat(path).st_mode)}; rankmem replaces only a "
                           "regular file: name a file")


# The largest value a number typed at the command line may take, by what its metavar says it counts: a
# number past it is a typo or an overflow (``--interval inf``, ``--size 60000x60000``), refused with one
# line and exit 2 before it reaches a sleep, an allocation or a fit.
_BOUNDS = {"S": (366 * 86400.0, "seconds (a year)"), "N": (1e9, ""), "GIB": (2.0**20, "GiB (a PiB)"),
           "MIB": (2.0**30, "MiB (a PiB)"), "FLOOR": (2.0**30, "MiB (a PiB)"), "TOKENS": (2.0**40, "tokens"),
           "T": (2.0**40, "tokens"), "L": (2.0**40, "tokens"), "WxH": (16384.0, "pixels a side")}
_DEFAULT_BOUND = (1e12, "")


def _bounded(convert: object, metavar: str | None) -> object:
    limit, unit = _BOUNDS.get(metavar or "", _DEFAULT_BOUND)

    def check(text: str) -> object:
        value = convert(text)  # type: ignore[operator]
        for number in value if isinstance(value, tuple) else (value,):
            # NaN is left to the subcommand's own checks, which name what the option means.
            if isinstance(number, (int, float)) and (math.isinf(number) or abs(number) > limit):
                at_most = f"at most {limit:,.0f} {unit}".rstrip()
                raise argparse.ArgumentTypeError(f"must be a finite number {at_most}, got {text!r}")
        return value

    check.__name__ = getattr(convert, "__name__", "number")  # argparse names the type in its messages
    return check


def bound_numbers(parser: argparse.ArgumentParser) -> None:
    """Give every numeric option of ``parser`` and its subcommands a finite range (:data:`_BOUNDS`);
    ``train``'s job options have theirs, with one-line messages, in :mod:`rankmem.engine.options`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                if name != "train":
                    bound_numbers(subparser)
        elif action.type is not None and action.type is not str and callable(action.type):
            metavar = action.metavar if isinstance(action.metavar, str) else None
            action.type = _bounded(action.type, metavar)  # type: ignore[assignment]


def add_leak_options(parser: argparse.ArgumentParser) -> None:
    d = LeakConfig()
    g = parser.add_argument_group("leak detection")
    g.add_argument("--window", type=float, default=d.window, metavar="FRAC",
                   help=f"examine the last FRAC of the logged steps, after warm-up (default {d.window})")
    g.add_argument("--last", type=int, default=None, metavar="N", help="examine the last N logged steps instead")
    g.add_argument("--min-steps", type=int, default=d.min_steps, metavar="N",
                   help=f"fewer logged steps in the window give no verdict (default {d.min_steps})")
    g.add_argument("--noise-factor", type=float, default=d.noise_factor, metavar="K",
                   help=f"the growth over the window must exceed K noise standard deviations plus the stakes "
                        f"floor (default {d.noise_factor:g})")
    g.add_argument("--capacity-fraction", type=float, default=d.capacity_fraction, metavar="F",
                   help=f"the stakes floor: this share of the memory a series grows into (default "
                        f"{d.capacity_fraction:g})")
    g.add_argument("--min-growth", type=float, default=d.min_growth_mib, metavar="MIB",
                   help=f"the stakes floor where that capacity is not in the log, MiB (default {d.min_growth_mib:g})")
    g.add_argument("--alpha", type=float, default=d.alpha,
                   help=f"largest Mann-Kendall p-value that counts as growth (default {d.alpha:g})")


def leak_config(args: argparse.Namespace) -> LeakConfig:
    """The leak options as a :class:`LeakConfig`; a non-finite number (``nan`` passes every ``<``
    comparison) is refused here with the flag's name."""
    for flag, value in (("--window", args.window), ("--min-growth", args.min_growth), ("--alpha", args.alpha),
                        ("--noise-factor", args.noise_factor), ("--capacity-fraction", args.capacity_fraction)):
        if not math.isfinite(value):
            raise RankmemError(f"{flag} must be a finite number, got {value}")
    return LeakConfig(window=args.window, last=args.last, min_steps=args.min_steps, noise_factor=args.noise_factor,
                      capacity_fraction=args.capacity_fraction, min_growth_mib=args.min_growth, alpha=args.alpha)


def check_keys(run: Run, keys: Sequence[str], flag: str = "--keys") -> None:
    """Every key asked for must be in the run log: a misspelt one would be silently left out."""
    missing = [k for k in keys if k not in run.series]
    if missing:
        raise RankmemError(f"{flag}: no such key(s) in the run log: {', '.join(missing)}; "
                           f"it has: {', '.join(sorted(run.series))}")


def require_steps(run: Run, command: str) -> None:
    """A run log with a header but no step lines is a user error for ``report`` and ``leaks`` alike."""
    if run.steps.size == 0 and (run.logged is None or run.logged.steps.size == 0):
        raise RankmemError(
            f"{run.path} has no logged steps: the run stopped, or its jsonl sink failed, before its first "
            f"collect() was written; see the job's output for why, and run rankmem {command} on a run log that has "
            "steps"
        )


def note_damage(run: Run, command: str) -> None:
    """What of the run could not be read, on stderr, one line each: a verdict or a plot drawn from a
    damaged run says so even where stdout is JSON or a file."""
    if run.detail_note:
        print(printable(f"rankmem {command}: note: {run.detail_note}"), file=sys.stderr)
    for gap in run.gaps:
        print(printable(f"rankmem {command}: gap: {gap}"), file=sys.stderr)
    if run.corrupt or run.truncated:
        print(f"rankmem {command}: note: skipped {run.corrupt} corrupt line(s)"
              f"{', a truncated last line or batch' if run.truncated else ''}", file=sys.stderr)
