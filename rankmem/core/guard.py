"""The failure boundary: telemetry never kills training.

Every place where rankmem's own measuring, writing or watching could fail runs inside a :class:`Guard`
(in the spirit of psutil's ``wrap_exceptions``: one place decides what a foreign exception becomes).
An exception inside becomes one ``RuntimeWarning`` per topic and a fallback value; a
:class:`~rankmem.errors.RankmemError` (a user error every rank meets alike) and anything that is not an
``Exception`` (KeyboardInterrupt, SystemExit) pass through untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from rankmem.core.warnings import WarnOnce
from rankmem.errors import RankmemError

T = TypeVar("T")


class Guard:
    """Runs telemetry code; a failure warns once per topic and yields a fallback instead of raising."""

    def __init__(self) -> None:
        self.warn_once = WarnOnce()
        self.failures = 0

    def failed(self, topic: str, what: str, exc: BaseException) -> None:
        self.failures += 1
        self.warn_once(topic, f"{what}: {exc!r}", stacklevel=4)

    def scope(self, topic: str, what: str) -> Scope:
        """``with guard.scope("sink", "the run log failed"):`` ... an exception inside ends the block.
        The scope is an object that can be kept and entered again. The window edges, run every step,
        apply the same rule in plain ``try`` blocks that call :meth:`failed` (free until one raises,
        where a ``with`` costs two Python calls)."""
        return Scope(self, topic, what)

    def call(self, topic: str, what: str, fn: Callable[..., T], *args: Any, default: T) -> T:
        """``fn(*args)``, or ``default`` (after one warning per topic) when it raises."""
        try:
            return fn(*args)
        except RankmemError:
            raise
        except Exception as exc:  # noqa: BLE001
            self.failed(topic, what, exc)
            return default


class Scope:
    """A guarded block: an :class:`Exception` inside (not a :class:`RankmemError`) ends the block with one
    warning per topic; anything else passes through."""

    __slots__ = ("_guard", "_topic", "_what")

    def __init__(self, guard: Guard, topic: str, what: str) -> None:
        self._guard, self._topic, self._what = guard, topic, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, RankmemError):
            return False
        self._guard.failed(self._topic, self._what, exc)  # the one place telemetry failures are caught
        return True


def attempt(fn: Callable[..., T], *args: Any, default: T, **kwargs: Any) -> T:
    """A call into a foreign API (torch's allocator, psutil, the driver) whose failure means "not
    available here": its value, or ``default``, without a warning (the caller decides whether the
    missing figure deserves one). psutil's ``wrap_exceptions`` plays this part for psutil."""
    try:
        return fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - any failure of a foreign probe is "unavailable"
        return default
