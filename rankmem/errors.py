"""rankmem's own error types: user errors carry a message that says what to do."""

from __future__ import annotations

import warnings


class RankmemError(ValueError):
    """A user error: bad configuration or input. The message says how to fix it."""


class MissingExtraError(RankmemError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""

    def __init__(self, feature: str, extra: str, package: str) -> None:
        super().__init__(f"{feature} needs {package}, which is not installed: pip install 'rankmem[{extra}]'")
        self.extra = extra


def warn(message: str, stacklevel: int = 2) -> None:
    """A ``RuntimeWarning`` that can never raise: under ``-W error`` (or pytest's
    ``filterwarnings = error``) a warning becomes an exception, and telemetry must not kill training,
    nor leave the logging rank dead while the others wait in the next collective."""
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
    except Exception:  # noqa: BLE001
        pass


class WarnOnce:
    """Telemetry warns about a condition once, not every step: one ``RuntimeWarning`` per key."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def __call__(self, key: str, message: str, stacklevel: int = 3) -> None:
        if key not in self._seen:
            self._seen.add(key)
            warn(f"rankmem: {message}", stacklevel=stacklevel + 1)
