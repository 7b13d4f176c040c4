"""rankmem's own error types: user errors carry a message that says what to do."""

from __future__ import annotations


class RankmemError(ValueError):
    """A user error: bad configuration or input. The message says how to fix it."""


class MissingExtraError(RankmemError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""

    def __init__(self, feature: str, extra: str, package: str, install: str | None = None) -> None:
        install = install or f"pip install 'rankmem[{extra}]'"
        super().__init__(f"{feature} needs {package}, which is not installed: {install}")
        self.extra = extra
