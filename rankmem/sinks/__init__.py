"""Where aggregated metrics go, on the logging rank only. Sinks are chosen by name or passed in.

Names follow verl's trackers where they match: ``console``, ``file``/``jsonl`` (the run log),
``tensorboard``, ``wandb``, ``mlflow``; and ``prometheus``, an endpoint for a cluster's Prometheus (or
Ray's metrics agent). Each tracker is an optional extra imported only when used. A named sink takes
keyword options from the Monitor's ``sink_options`` (``{"prometheus": {"port": 9465}}``), checked
against the sink's constructor here, with the sink names, before any rank starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from rankmem.core.records import RunHeader, StepRecord
from rankmem.core.warnings import warn
from rankmem.errors import MissingExtraError, RankmemError

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
    "prometheus": ("rankmem.sinks._prometheus", "PrometheusSink", "prometheus", "prometheus_client"),
}
SINK_NAMES = tuple(_REGISTRY)
_NEEDS_DIR = ("jsonl", "file", "tensorboard")


def check_sink_specs(specs: Sequence[str | Sink], out_dir: str | None,
                     options: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Every check of sink names, their directory and their options, in one place (the Monitor's
    config calls it)."""
    for spec in specs:
        if isinstance(spec, str) and spec not in _REGISTRY:
            raise RankmemError(f"unknown sink {spec!r}: choose from {', '.join(SINK_NAMES)}")
        if not isinstance(spec, (str, Sink)):
            raise RankmemError(f"a sink must be one of {', '.join(SINK_NAMES)} or have open/write/close; got {spec!r}")
    if out_dir is None and any(s in _NEEDS_DIR for s in specs if isinstance(s, str)):
        raise RankmemError("the jsonl/file/tensorboard sinks write to a directory: set out_dir='runs/NAME'")
    for name, given in (options or {}).items():
        if name not in specs:
            named = [s for s in specs if isinstance(s, str)]
            raise RankmemError(f"sink_options names the sink {name!r}, which is not among sinks {named}: add it to "
                               "sinks, or drop its options")
        if not isinstance(given, Mapping):
            raise RankmemError(f"sink_options[{name!r}] must be a dict of keyword options, got {given!r}")
        known = sink_option_names(name)
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise RankmemError(f"unknown option(s) {unknown} for the {name} sink; known: {list(known)}")


def sink_option_names(name: str) -> tuple[str, ...]:
    """The keyword options a named sink takes (its constructor's, less ``out_dir``). Imports the sink's
    module, not its tracker: each imports its package only when opened."""
    module_name, cls_name, _, _ = _REGISTRY[name]
    cls = getattr(importlib.import_module(module_name), cls_name)
    params = inspect.signature(cls).parameters
    return tuple(p for p in params if p != "out_dir")


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


def make_sinks(specs: Sequence[str | Sink], out_dir: str | None, options: Mapping[str, Mapping[str, Any]]
               ) -> list[Sink]:
    """Every sink of a Monitor's config: each named one built with its ``options[name]``, objects as given."""
    return [make_sink(spec, out_dir, **(options.get(spec, {}) if isinstance(spec, str) else {})) for spec in specs]


class SafeSink:
    """Telemetry never kills training, and a brief outage never ends a sink's run.

    An exception from a sink starts an outage: the record is lost, and the sink is tried again after
    skipping 1, 2, 4, ... up to :data:`MAX_SKIP` records, with a warning when the first outage starts and
    one when each ends (the steps lost); a sink whose ``open`` failed is opened again at its next try. A
    :class:`RankmemError` is a configuration error: it warns once and disables the sink.
    """

    MAX_SKIP = 64
    """Most records skipped between two tries: a sink back from an outage loses at most this many more."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.disabled = False
        self.lost = 0
        """Records lost to outages over the run (failed or skipped)."""
        self._header: RunHeader | None = None
        self._opened = False
        self._outage: _Outage | None = None
        self._outages = 0

    @property
    def _name(self) -> str:
        return type(self.sink).__name__

    def open(self, header: RunHeader) -> None:
        self._header = header
        self._try_open(None)

    def _try_open(self, step: int | None) -> bool:
        assert self._header is not None
        error = self._call(self.sink.open, self._header)
        if error is not None:
            self._failed("open", step, error)
            return False
        self._opened = True
        return True

    @staticmethod
    def _call(method: Any, *args: Any) -> Exception | None:
        """The sink's ``method(*args)``; what it raised, or None. The one place a sink's failures are
        caught (a boundary of :mod:`rankmem.core.guard`): any of them must stay out of the training loop."""
        try:
            method(*args)
        except Exception as exc:  # noqa: BLE001 - the sinks' boundary
            return exc
        return None

    def write(self, record: StepRecord) -> None:
        if self.disabled or self._header is None:
            return
        outage = self._outage
        if outage is not None and outage.skip > 0:
            outage.skip -= 1
            outage.lose(record.step)
            self.lost += 1
            return
        if not self._opened and not self._try_open(record.step):
            return
        error = self._call(self.sink.write, record)
        if error is not None:
            self._failed("write", record.step, error)
            return
        if self._outage is not None:
            self._recovered(record.step)

    def _failed(self, method: str, step: int | None, exc: Exception) -> None:
        if isinstance(exc, RankmemError):
            self.disabled = True
            warn(f"rankmem: sink {self._name} failed in {method}() and is disabled: {exc}", stacklevel=4)
            return
        outage = self._outage
        if outage is None:
            outage = self._outage = _Outage(method, exc)
            self._outages += 1
            if self._outages == 1:
                at = "" if step is None else f" at step {step}"
                warn(f"rankmem: sink {self._name} failed in {method}(){at}: {exc!r}; retrying it with backoff "
                     "(the steps lost are reported when it recovers)", stacklevel=4)
        outage.tries += 1
        outage.skip = min(2 ** (outage.tries - 1), self.MAX_SKIP)
        outage.method, outage.error = method, exc
        if step is not None:
            outage.lose(step)
            self.lost += 1

    def _recovered(self, step: int) -> None:
        outage, self._outage = self._outage, None
        assert outage is not None
        warn(f"rankmem: sink {self._name} is writing again from step {step}; {outage.describe()}", stacklevel=4)

    def flush(self) -> None:
        """The sink's own ``flush()``, where it has one (the run log's per-rank batch); failures count
        as the sink's, never the caller's."""
        flush = getattr(self.sink, "flush", None)
        if flush is None or self.disabled or not self._opened:
            return
        error = self._call(flush)
        if error is not None:
            self._failed("flush", None, error)

    def close(self) -> None:
        # A sink in an outage still holds files or a tracker run: always try to close it.
        error = self._call(self.sink.close)
        if error is not None and not self.disabled and self._outage is None:
            warn(f"rankmem: sink {self._name} failed in close(): {error!r}")
        if self._outage is not None and not self.disabled:
            warn(f"rankmem: sink {self._name} was still failing when closed; {self._outage.describe()}")
        self._outage = None
        self.disabled = True


class _Outage:
    """One span of failures of a sink: the steps it lost, and the last error."""

    def __init__(self, method: str, error: Exception) -> None:
        self.method = method
        self.error = error
        self.tries = 0
        self.skip = 0
        self.first: int | None = None
        self.last: int | None = None
        self.lost = 0

    def lose(self, step: int) -> None:
        if self.first is None:
            self.first = step
        self.last = step
        self.lost += 1

    def describe(self) -> str:
        span = "no step" if self.first is None else (
            f"step {self.first}" if self.first == self.last else f"steps {self.first}..{self.last}")
        return (f"{self.lost} logged step(s) lost ({span}) over {self.tries} failed "
                f"tr{'y' if self.tries == 1 else 'ies'},"
                f" the last in {self.method}() with {self.error!r}")
