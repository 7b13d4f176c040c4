"""The ``rankmem`` command: ``train`` (launch the reference worker), ``report``, ``plot``, ``leaks``,
``watch`` (a live view of a running job), ``doctor`` (check the install) and ``completion`` (a shell
completion script).

Each subcommand lives in its own module with ``add_arguments(parser)`` and ``run(args) -> int``,
imported only when chosen. User errors (:class:`rankmem.RankmemError`, a missing file) print one line
naming the fix and exit 2, without a traceback. A mistyped command or flag gets the nearest real one
(:mod:`rankmem.cli._suggest`); the read commands default to the newest run under ``runs/``
(:mod:`rankmem.cli._runs`); warnings print as one ``rankmem: ...`` line (:mod:`rankmem.cli._showwarning`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from rankmem.cli import _suggest
from rankmem.cli._common import bound_numbers
from rankmem.cli._showwarning import one_line_warnings
from rankmem.core.text import printable
from rankmem.errors import RankmemError

# name -> (module, one-line help)
COMMANDS = {
    "train": ("rankmem.cli._train", "launch the reference engine worker under torchrun or Ray"),
    "report": ("rankmem.cli._report",
               "summarise a run log: events, leaks, the worst rank per key and per phase, capacity and headroom"),
    "plot": ("rankmem.cli._plot",
             "plot per-rank memory against step, capacity drawn, to a PNG (default RUN/rankmem.png)"),
    "advise": ("rankmem.cli._advise", "per phase, the largest tokens per micro-batch that fit (verl's config names)"),
    "leaks": ("rankmem.cli._leaks", "detect steadily growing memory per rank (exit 1 when found)"),
    "export": ("rankmem.cli._export", "write the per-rank values as a Parquet table (the parquet extra)"),
    "watch": ("rankmem.cli._watch", "a live per-rank view of a running job: memory, step, phase, events"),
    "doctor": ("rankmem.cli._doctor", "check this install: versions, device backend, peak scope, cgroup, extras"),
    "completion": ("rankmem.cli._completion", 'print a shell completion script: eval "$(rankmem completion bash)"'),
}

READERS = ("report", "plot", "advise", "leaks", "export", "watch")
"""The commands that only read a run: no child of theirs trains."""


def build_parser(only: str | None = "*") -> argparse.ArgumentParser:
    """Every subcommand's parser, or (``only``) one's: the others' modules are not imported (the top
    level's help needs none of them)."""
    from rankmem.core.version import __version__

    parser = argparse.ArgumentParser(prog="rankmem", description="Per-rank memory telemetry for distributed PyTorch.")
    parser.add_argument("--version", action="version", version=f"rankmem {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only in ("*", name):
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    bound_numbers(parser)
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _suggest.first_positional(argv)
    if command in READERS and "numpy" not in sys.modules:
        # One BLAS thread (unless the user says otherwise): a reader's arrays are small for BLAS, and
        # starting OpenBLAS's threads costs ~60 ms of CPU, a third of a 20k-step report (bench/RESULTS.md).
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    parser = build_parser(command)
    _suggest.check_command(parser, argv, COMMANDS)
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if extra:  # the subcommand's usage and the nearest flag, not the top level's usage
        _suggest.refuse_unknown(_subparser(parser, args.command), extra)
    with one_line_warnings():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        rc = int(args._run(args))
        sys.stdout.flush()  # here, not at exit: a reader that left (`| head -1`) is answered below
        return rc
    except BrokenPipeError:
        # The reader has what it wanted (`rankmem report RUN | head -1`): no traceback, no error at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except RankmemError as exc:
        # it may quote the run's keys
        print("\n".join(map(printable, f"rankmem {args.command}: error: {exc}".split("\n"))), file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        print(printable(f"rankmem {args.command}: error: {exc.strerror}: {exc.filename}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
