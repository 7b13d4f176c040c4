"""verl with no edit to verl: :func:`setup` is Ray's ``worker_process_setup_hook`` (docs/integrations.md).

Ray runs it in every worker of the job (TaskRunner, rollout servers, reward actors), so this module
imports only the standard library, never raises and only installs an import hook; the patch
(:mod:`._patch`) is imported when a worker imports verl's engine worker module. The hand-written API
(:func:`metrics_for_gather`, :func:`tell_micro_batches`, ...) is :mod:`._gather`'s, loaded on first use.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import warnings

TYPE_CHECKING = False  # not typing's: importing typing would double the hook's time
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence  # noqa: I001
    from typing import Any

    from rankmem.integrations.verl._gather import (VERL_NAMES, VerlDictGather,
        allgather_dict_into_dict, metrics_for_gather, tell_micro_batches, verl_reduction)

__all__ = ["VERL_NAMES", "VerlDictGather", "allgather_dict_into_dict", "metrics_for_gather",
           "runtime_env_hook", "setup", "tell_micro_batches", "verl_reduction"]

ENGINE_WORKERS = "verl.workers.engine_workers"  # its import applies the patch


def setup() -> None:
    """Ray's ``worker_process_setup_hook``: patch verl's engine worker when (if) this process imports it."""
    _never_raise("installing the import hook", _install)


def runtime_env_hook(runtime_env: dict[str, Any] | None) -> dict[str, Any]:
    """For ``RAY_RUNTIME_ENV_HOOK=rankmem.integrations.verl.runtime_env_hook``: the driver's runtime env
    with :func:`setup` as the workers' setup hook (one the user set is kept)."""
    env = dict(runtime_env or {})
    env.setdefault("worker_process_setup_hook", f"{__name__}.setup")
    return env


def _install() -> None:
    module = sys.modules.get(ENGINE_WORKERS)
    if module is not None:  # it has just run (the loader's call), or ran before the hook did
        importlib.import_module(f"{__name__}._patch").apply(module)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder:
    """Finds verl's engine worker module where Python would, with a loader that patches it once run."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        spec: Any = importlib.machinery.PathFinder.find_spec(name, path) if name == ENGINE_WORKERS else None
        if spec is not None and hasattr(spec.loader, "exec_module"):  # in the package verl's finder found
            spec.loader = _Loader(spec.loader)
        return spec


class _Loader:
    """The module's own loader; once the module has run, the patch is applied to it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:  # create_module, get_source (inspect, linecache), ...
        return getattr(self._inner, name)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)  # verl's own import errors propagate as without rankmem
        _never_raise("patching verl's engine worker", _install)  # sys.modules holds it now


def _never_raise(what: str, fn: Callable[..., None], *args: Any) -> None:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the hook's boundary: a verl worker must start without rankmem
        warnings.warn(f"rankmem: {what} failed, this worker runs without rankmem: {exc!r}", RuntimeWarning,
                      stacklevel=2)


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}._gather"), name)
    globals()[name] = value
    return value
