"""How the ``rankmem`` command prints a warning: one ``rankmem: ...`` line, paths relative to the
working directory (or to the checkout rankmem runs from), instead of Python's
``/abs/path/file.py:12: RuntimeWarning: rankmem: ...`` and the source line under it.

Installed by :func:`rankmem.cli.main` for the command only: a program that imports rankmem keeps its
own ``warnings.showwarning``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from typing import TextIO

# The directory holding the rankmem package: a checkout's root, or site-packages.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def relative(path: str, cwd: str | None = None) -> str:
    """``path`` relative to ``cwd`` when under it, else to rankmem's root when under that, else as given."""
    if not os.path.isabs(path):
        return path
    for base in (cwd or os.getcwd(), _ROOT):
        if path == base:
            return "."
        if path.startswith(base.rstrip(os.sep) + os.sep):
            return os.path.relpath(path, base)
    return path


def _relative_in(text: str, cwd: str) -> str:
    for base in (cwd, _ROOT):
        text = text.replace(base.rstrip(os.sep) + os.sep, "")
    return text


def format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                   cwd: str | None = None) -> str:
    """The one line (with its newline) a warning prints as under the command."""
    cwd = cwd or os.getcwd()
    text = " ".join(_relative_in(str(message), cwd).split())  # one line, whatever the message held
    if text.startswith("rankmem: "):  # rankmem's own (core.warnings): the prefix is already the name
        return f"{text}\n"
    where = "" if filename.startswith("<") or lineno == 0 else f" ({relative(filename, cwd)}:{lineno})"
    return f"rankmem: {category.__name__}: {text}{where}\n"


def _show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
          file: TextIO | None = None, line: str | None = None) -> None:
    try:
        (file or sys.stderr).write(format_warning(message, category, filename, lineno))
    except (OSError, ValueError):  # stderr gone: a warning is not worth an exception
        pass


def _recorded() -> bool:
    """Whether warnings are being recorded (``catch_warnings(record=True)``, as pytest does): then they
    are the recorder's, and printing them would take them from it."""
    impl = getattr(warnings, "_showwarnmsg_impl", None)
    return getattr(impl, "__module__", None) != "warnings"


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    if _recorded():
        yield
        return
    previous = warnings.showwarning
    warnings.showwarning = _show
    try:
        yield
    finally:
        warnings.showwarning = previous
