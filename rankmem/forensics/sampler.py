"""Sampled step windows on a CUDA device: what held its peak, by holder, at a small cost per sample.

A sampled step records the allocator's history (``_record_memory_history(context="alloc",
stacks="python")``: C++ stacks cost minutes to symbolise, torchtitan#3628) from its open, after the
baseline of live blocks (``memory_snapshot(include_traces=False)``, which also marks the trace); forward
hooks tag each allocation ``phase|module|fwd`` through ``_set_memory_metadata`` where torch has it. At
close: ``_snapshot()``, history back to what ``oom_history`` asked, and the replay
(:mod:`rankmem.forensics.replay`) on a thread of its own, into an ``anatomy`` event of this rank. The
forensics hand it each OOM snapshot too. Which steps: every ``every``-th, the one after a step whose
peak crossed ``share`` of capacity, and the next after :meth:`Anatomy.request`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

from rankmem.core.eventrecords import Event
from rankmem.core.warnings import WarnOnce
from rankmem.forensics.replay import Addresses, replay
from rankmem.probe.device import DeviceBackend
from rankmem.windows import Where

_PEAK, _TOTAL = "mem/device/peak_allocated_gib", "mem/device/total_gib"


def addresses(tracked: Iterable[tuple[Any, Any]], ptr: Callable[[Any], int] | None = None) -> Addresses:
    """The storage addresses of the parameters, gradients and optimizer state (tensors of dimension >= 1,
    as step counters are scalars) of ``(model, optimizer or None)`` pairs."""
    ptr = ptr or (lambda t: int(t.untyped_storage().data_ptr()))
    params: set[int] = set()
    grads: set[int] = set()
    state: set[int] = set()
    for model, optimizer in tracked:
        for p in model.parameters():
            params.add(ptr(p))
            if p.grad is not None:
                grads.add(ptr(p.grad))
        for values in (optimizer.state.values() if optimizer is not None else ()):
            state.update(ptr(v) for v in values.values() if getattr(v, "ndim", 0) >= 1)
    return Addresses(frozenset(params), frozenset(grads), frozenset(state))


class ModuleTags:
    """Global forward hooks that tag the allocations inside each module's forward ``phase|fqn|fwd``
    (``infer`` under no_grad: nothing is kept for a backward) and the enclosing module's tag after it."""

    def __init__(self, set_metadata: Callable[[str], Any], phase: Callable[[], str | None]) -> None:
        self._set, self._phase = set_metadata, phase
        self.names: dict[int, str] = {}
        self._stack: list[str] = []
        self._handles: list[Any] = []

    def name(self, model: Any) -> None:
        self.names.update((id(m), n or type(m).__name__) for n, m in model.named_modules())

    def install(self) -> None:
        from torch.nn.modules import module as hooks

        self._stack = []
        self._handles = [hooks.register_module_forward_pre_hook(self._enter),
                         hooks.register_module_forward_hook(self._leave, always_call=True)]
        self._set(f"{self._phase() or ''}||")

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._set("")

    def _enter(self, module: Any, args: Any) -> None:
        import torch

        stage = "fwd" if torch.is_grad_enabled() else "infer"
        name = self.names.get(id(module), type(module).__name__)
        self._stack.append(f"{self._phase() or ''}|{name}|{stage}")
        self._set(self._stack[-1])

    def _leave(self, module: Any, args: Any, out: Any) -> None:
        if self._stack:
            self._stack.pop()
        self._set(self._stack[-1] if self._stack else f"{self._phase() or ''}||")


class Anatomy:
    """This rank's sampled windows and OOM replays; ``write`` takes the ``anatomy`` events."""

    def __init__(self, device: DeviceBackend, write: Callable[[Event], object], where: Callable[[], Where], *,
                 every: int = 0, share: float | None = None, entries: int = 50_000, history: int = 0,
                 top: int = 8) -> None:
        self.device, self._write, self._where = device, write, where
        self.every, self.share, self.entries, self.history, self.top = every, share, entries, history, top
        self.tracked: list[tuple[Any, Any]] = []
        set_metadata = device.set_metadata_hook()
        self.tags = ModuleTags(set_metadata, lambda: where().phase) if set_metadata is not None else None
        self._steps = 0
        self._armed = False
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        self._warn_once = WarnOnce()

    def track(self, model: Any, optimizer: Any = None) -> None:
        self.tracked.append((model, optimizer))
        if self.tags is not None:
            self.tags.name(model)

    def request(self) -> None:
        self._armed = True

    def after_collect(self, local: Mapping[str, float]) -> None:
        """Arm the next step when this one peaked above ``share`` of the device's capacity."""
        peak, total = local.get(_PEAK), local.get(_TOTAL)
        if self.share is not None and peak is not None and total and peak >= self.share * total:
            self._armed = True

    def step(self, window: AbstractContextManager[None]) -> AbstractContextManager[None]:
        self._steps += 1
        if not self._armed and not (self.every and self._steps % self.every == 0):
            return window
        self._armed = False
        return _Sampled(self, window)

    def replay_async(self, snapshot: Mapping[str, Any], baseline: Any, where: Where, source: str) -> None:
        """Replay on the replay thread, in turn; a sample is skipped while two wait (each holds a
        snapshot)."""
        self._pending = [f for f in self._pending if not f.done()]
        if source == "sample" and len(self._pending) >= 2:
            return
        owned = addresses(self.tracked)  # here, on the caller's thread: the tensors change under training
        self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="rankmem-replay")
        self._pending.append(self._pool.submit(self._replay, snapshot, baseline, owned, where, source))

    def _replay(self, snapshot: Mapping[str, Any], baseline: Any, owned: Addresses, where: Where,
                source: str) -> None:
        try:
            found = replay(snapshot, baseline, owned, top=self.top, device=self.device.last_index or 0)
            extra = {"source": source, **found}
            self._write(Event(kind="anatomy", step=where.step, phase=where.phase, extra=extra))
        except Exception as exc:  # noqa: BLE001  (a snapshot of another torch's schema: named, never raised)
            self._warn_once("replay", f"rankmem: replaying the allocator history failed ({exc!r}); "
                            "no anatomy event")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # the pending event is written before the event file closes
            self._pool = None


class _Sampled:
    """A step window whose allocator history is recorded and replayed."""

    def __init__(self, anatomy: Anatomy, window: AbstractContextManager[None]) -> None:
        self.anatomy, self.window = anatomy, window
        self.baseline: list[Any] | None = None

    def __enter__(self) -> None:
        a = self.anatomy
        if a.device.record_history(a.entries, clear=True):
            self.baseline = a.device.live_segments()
            if a.tags is not None:
                a.tags.install()
        self.window.__enter__()

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> bool | None:
        try:
            return self.window.__exit__(kind, error, tb)
        finally:
            a = self.anatomy
            try:
                if a.tags is not None:
                    a.tags.remove()
                snapshot = a.device.snapshot() if self.baseline is not None else None
                a.device.record_history(a.history)  # back to oom_history's ring, or off
                if snapshot is not None:
                    a.replay_async(snapshot, self.baseline, a._where(), "sample")
            except Exception as exc:  # noqa: BLE001  (telemetry never raises into training)
                a._warn_once("sample", f"rankmem: sampling the allocator history failed ({exc!r})")
