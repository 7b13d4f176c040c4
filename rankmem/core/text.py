"""Strings from a run log, shown as text: nothing in them may reach a terminal as a control.

A metric key, a phase name, an OOM message, an event field or a host name comes from a file any
process can write. Printed raw, ``\\x1b]0;...\\x07`` sets the window title and ``\\x1b[2J`` clears the
screen; a carriage return or a bidi override (U+202E) makes a line say something it does not hold.
:func:`printable` escapes every control and format character as Python does in a ``repr``
(``\\x1b``, ``\\u202e``), and leaves every other character, non-ASCII included, as it is. Rich markup
is a second language in the same strings (``[red]`` vanished, ``[/x]`` raised): where rich draws
them, they go in as :class:`rich.text.Text` (see the offline renderers), never parsed as markup.
"""

from __future__ import annotations

import re
import unicodedata

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_FORMAT_CATEGORIES = ("Cf", "Cs", "Zl", "Zp")


def _escape(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: object) -> str:
    """``text`` (made a string) with its control characters, format characters (bidi overrides, zero
    widths), surrogates and line/paragraph separators escaped; a backslash stays one backslash."""
    s = text if isinstance(text, str) else str(text)
    if s.isascii():
        return _CONTROL.sub(lambda m: _escape(m.group()), s) if _CONTROL.search(s) else s
    return "".join(_escape(ch) if _CONTROL.match(ch) or unicodedata.category(ch) in _FORMAT_CATEGORIES else ch
                   for ch in s)
