"""Where aggregated metrics go, on the logging rank only. Sinks are chosen by name or passed in.

Names follow verl's trackers where they match: ``console``, ``file``/``jsonl`` (the run log),
``tensorboard``, ``wandb``, ``mlflow``. Each tracker is an optional extra imported only when used.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from rankmem._records import RunHeader, StepRecord
from rankmem.errors import MissingExtraError, RankmemError, warn

__all__ = ["Sink", "SINK_NAMES", "check_sink_specs", "make_sink", "SafeSink"]


@runtime_checkable
class Sink(Protocol):
    """Receives the run header once, then one record per logged step. Called on the logging rank."""

    def open(self, header: RunHeader) -> None: ...

    def write(self, record: StepRecord) -> None: ...

    def close(self) -> None: ...


# name -> (module, class, extra that provides its package, package imported)
_REGISTRY: dict[str, tuple[str, str, str | None, str | None]] = {
    "console": ("rankmem.sinks._console", "ConsoleSink", None, None),
    "jsonl": ("rankmem.sinks._jsonl", "JsonlSink", None, None),
    "file": ("rankmem.sinks._jsonl", "JsonlSink", None, None),
    "tensorboard": ("rankmem.sinks._tensorboard", "TensorBoardSink", "tensorboard", "tensorboard"),
    "wandb": ("rankmem.sinks._wandb", "WandbSink", "wandb", "wandb"),
    "mlflow": ("rankmem.sinks._mlflow", "MlflowSink", "mlflow", "mlflow"),
}
SINK_NAMES = tuple(_REGISTRY)
_NEEDS_DIR = ("jsonl", "file", "tensorboard")


def check_sink_specs(specs: Sequence[str | Sink], out_dir: str | None) -> None:
    """Every check of sink names and their directory, in one place (the Monitor's config calls it)."""
    for spec in specs:
        if isinstance(spec, str) and spec not in _REGISTRY:
            raise RankmemError(f"unknown sink {spec!r}: choose from {', '.join(SINK_NAMES)}")
        if not isinstance(spec, (str, Sink)):
            raise RankmemError(f"a sink must be one of {', '.join(SINK_NAMES)} or have open/write/close; got {spec!r}")
    if out_dir is None and any(s in _NEEDS_DIR for s in specs if isinstance(s, str)):
        raise RankmemError("the jsonl/file/tensorboard sinks write to a directory: set out_dir='runs/NAME'")


def make_sink(spec: str | Sink, out_dir: str | None = None, **options: Any) -> Sink:
    """Build a sink from its name (``out_dir`` is where file-backed sinks write), or pass one through."""
    check_sink_specs([spec], out_dir)
    if not isinstance(spec, str):
        return spec
    module_name, cls_name, extra, package = _REGISTRY[spec]
    if package is not None and importlib.util.find_spec(package) is None:
        raise MissingExtraError(f"the {spec} sink", extra or spec, package)
    module = importlib.import_module(module_name)
    cls = getattr(module, cls_name)
    sink: Sink = cls(out_dir=out_dir, **options)
    return sink


class SafeSink:
    """Telemetry never kills training: the first exception from a sink warns once and disables it."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.disabled = False

    def _call(self, method: str, *args: Any) -> None:
        if self.disabled:
            return
        try:
            getattr(self.sink, method)(*args)
        except Exception as exc:  # noqa: BLE001 - any sink failure must stay out of the training loop
            self.disabled = True
            warn(f"rankmem: sink {type(self.sink).__name__} failed in {method}() and is disabled: {exc!r}", stacklevel=3)

    def open(self, header: RunHeader) -> None:
        self._call("open", header)

    def write(self, record: StepRecord) -> None:
        self._call("write", record)

    def close(self) -> None:
        # A sink disabled by a failed write still holds files or a tracker run: always try to close it.
        try:
            self.sink.close()
        except Exception as exc:  # noqa: BLE001
            if not self.disabled:
                warn(f"rankmem: sink {type(self.sink).__name__} failed in close(): {exc!r}")
        self.disabled = True
