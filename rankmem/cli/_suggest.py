"""Did-you-mean for the ``rankmem`` command: a mistyped subcommand or flag gets the nearest real one,
and a subcommand's error shows that subcommand's usage (argparse alone shows the top-level one for an
unknown flag, since the subparser hands unknown arguments back to its parent)."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable, Sequence


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The nearest of ``choices`` to ``word``, or None when none is near (difflib's 0.6 cut-off)."""
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def first_positional(argv: Sequence[str]) -> str | None:
    """The command word: the first argument not an option (the top level has no option taking a value)."""
    for arg in argv:
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return arg
    return None


def check_command(parser: argparse.ArgumentParser, argv: Sequence[str], commands: Iterable[str]) -> None:
    """Exit 2 with the top-level usage and the nearest command when the command word is not one."""
    word = first_positional(argv)
    names = list(commands)
    if word is None or word in names:
        return
    near = closest(word, names)
    hint = f"; did you mean '{near}'?" if near else f"; the commands are: {', '.join(names)}"
    parser.error(f"no command '{word}'{hint}")


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings]


def refuse_unknown(parser: argparse.ArgumentParser, extra: Sequence[str]) -> None:
    """Exit 2 with ``parser``'s (the subcommand's) usage, naming each unknown argument and the nearest flag."""
    flags = option_strings(parser)
    parts = []
    for arg in extra:
        if arg.startswith("-"):
            near = closest(arg.split("=", 1)[0], flags)
            parts.append(f"{arg} (did you mean {near}?)" if near else arg)
        else:
            parts.append(arg)
    parser.error(f"unrecognized arguments: {' '.join(parts)}")
