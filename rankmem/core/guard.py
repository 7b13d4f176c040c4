"""The failure boundaries: telemetry never kills training.

A boundary is a handler that catches every ``Exception``: where a failure of rankmem's own measuring,
writing or watching becomes a warning (or a figure marked unavailable) and training goes on. Everywhere
else code catches the types it expects and tells errors apart by type, never by text. A
:class:`~rankmem.errors.RankmemError` (a user error every rank meets alike) passes the training thread's
boundaries; anything that is not an ``Exception`` passes them all. ``tests/core/test_guard.py`` fails
for a broad handler in the package not listed here.

The boundaries (``file: function``: where it stands, why):

- ``core/guard.py: Guard.call``, and its ``with`` form :meth:`Guard.scope` (:class:`Scope`): the
  training thread; a failure warns once per topic and yields a fallback. :meth:`Guard.contain` is the
  same where no caller could be told, so a RankmemError ends the block too: rankmem's own threads, the
  signal handler's flush, the clean-up while a framework's exception propagates.
- ``windows.py: Windows._edge``: the same rule as :meth:`Guard.call` written inline for the probe and
  the listener at every window edge, the hot path; other failures go to the window's Guard.
- ``core/guard.py: attempt``: a call into a foreign probe whose failure means "not available here".
- ``core/guard.py: load_optional``: importing an optional dependency, which a broken install makes
  raise anything, not only ``ImportError``.
- ``sinks/__init__.py: SafeSink._call``: every call into a sink: an outage, retried with backoff.
- ``core/warnings.py: warn``: the warning channel itself (``-W error``, a logging hook that raises).
- ``forensics/sampler.py: HistorySampler._sampled``: a sampled step's allocator history: one warning.
- ``forensics/sampler.py: HistorySampler._replay``: its replay off the training thread: one warning per
  topic, no ``anatomy`` event.
- ``core/scalars.py: plain_config.key``, ``core/scalars.py: plain_config.mapping``: a caller's key's
  ``__str__`` or mapping's ``items()`` may raise anything: a marker in the header, never a failed ``Monitor()``.
- ``integrations/verl/__init__.py: _never_raise``: Ray's worker-process setup hook and the patch it
  applies to verl's engine worker: one warning, and the worker starts without rankmem.

Not boundaries: a handler that cleans up and re-raises (in ``windows.py``, ``core/rundir.py``,
``integrations/hf.py`` and ``ray/cluster.py``) lets everything through.
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

    def contain(self, topic: str, what: str) -> Scope:
        """:meth:`scope` for code no caller can be told about by an exception (a thread rankmem started,
        a signal handler, clean-up while another exception propagates): a RankmemError ends the block
        as well, with the same one warning per topic."""
        return Scope(self, topic, what, passes=())

    def call(self, topic: str, what: str, fn: Callable[..., T], *args: Any, default: T) -> T:
        """``fn(*args)``, or ``default`` (after one warning per topic) when it raises."""
        try:
            return fn(*args)
        except RankmemError:
            raise
        except Exception as exc:  # noqa: BLE001 - the training thread's boundary
            self.failed(topic, what, exc)
            return default


class Scope:
    """A guarded block: an :class:`Exception` inside (not one of ``passes``) ends the block with one
    warning per topic; anything else passes through. :attr:`error` is what ended the last block."""

    __slots__ = ("_guard", "_topic", "_what", "_passes", "error")

    def __init__(self, guard: Guard, topic: str, what: str,
                 passes: tuple[type[Exception], ...] = (RankmemError,)) -> None:
        self._guard, self._topic, self._what, self._passes = guard, topic, what, passes
        self.error: Exception | None = None

    def __enter__(self) -> Scope:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, self._passes):
            self.error = None
            return False
        self.error = exc
        self._guard.failed(self._topic, self._what, exc)
        return True


def attempt(fn: Callable[..., T], *args: Any, default: T, **kwargs: Any) -> T:
    """A call into a foreign API (torch's allocator, psutil, the driver) whose failure means "not
    available here": its value, or ``default``, without a warning (the caller decides whether the
    missing figure deserves one). psutil's ``wrap_exceptions`` plays this part for psutil."""
    try:
        return fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - any failure of a foreign probe is "unavailable"
        return default


def load_optional(load: Callable[[], T]) -> tuple[T | None, Exception | None]:
    """``(load(), None)``, or ``(None, the exception)`` when importing an optional dependency that is
    installed (the caller has found it with ``find_spec``) fails: the caller says "broken" or "reinstall"."""
    try:
        return load(), None
    except Exception as exc:  # noqa: BLE001 - a broken install raises anything, not only ImportError
        return None, exc
