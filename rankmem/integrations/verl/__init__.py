"""verl: rankmem in every engine worker of a verl job with no edit to verl, through Ray's setup hook.

``+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=rankmem.integrations.verl.setup`` on verl's
command line makes Ray call :func:`setup` in every worker process of the job (docs/integrations.md).
The hook runs in the TaskRunner, the rollout servers and the reward actors too, so this module imports
only the standard library, never raises and returns in well under a millisecond: it installs an import
hook and nothing else. The patch itself (:mod:`rankmem.integrations.verl._patch`) is imported only when
the worker imports verl's engine worker module; a process that never does pays nothing.

The functions a hand-written integration calls (:func:`metrics_for_gather`, :func:`tell_micro_batches`,
:func:`allgather_dict_into_dict`, ...) live in :mod:`rankmem.integrations.verl._gather` and are
imported from here on first use.
"""

from __future__ import annotations

import importlib
import sys
import warnings

TYPE_CHECKING = False  # not typing's: importing typing would double the hook's time
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

    from rankmem.integrations.verl._gather import (
        VERL_NAMES,
        VerlDictGather,
        allgather_dict_into_dict,
        metrics_for_gather,
        tell_micro_batch,
        tell_micro_batches,
        verl_reduction,
    )

__all__ = ["VERL_NAMES", "VerlDictGather", "allgather_dict_into_dict", "metrics_for_gather", "setup",
           "tell_micro_batch", "tell_micro_batches", "verl_reduction"]

ENGINE_WORKERS = "verl.workers.engine_workers"
"""The module whose import applies the patch: verl's ``TrainingWorker`` and ``ActorRolloutRefWorker``."""


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
    if module is not None:  # imported before the hook ran (a second call, a user's own setup)
        _apply(module)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder:
    """Finds nothing itself: for verl's engine worker module it wraps the loader the other finders give."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if name != ENGINE_WORKERS:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if finder is not self and find is not None else None
            if spec is not None:
                if hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader:
    """The module's own loader; once the module has run, the patch is applied to it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...: inspect and linecache ask
        return getattr(self._inner, name)

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)  # verl's own import errors propagate as without rankmem
        _never_raise("patching verl's engine worker", _apply, module)


def _apply(module: Any) -> None:
    importlib.import_module(f"{__name__}._patch").apply(module)


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
