"""Sampled step windows on a CUDA device (every ``every``-th, the one after a step that reached
``share`` of capacity, the one after :meth:`HistorySampler.request`): the allocator's history from a baseline
of the live blocks, Python stacks only (C++ ones take minutes to symbolise, torchtitan#3628), each
allocation tagged ``phase|module|fwd`` by forward hooks; at close ``_snapshot()``, the history back
to ``oom_history``'s, and the replay on a thread of its own into an ``anatomy`` event. OOM snapshots too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from rankmem.core.events import Event
from rankmem.core.guard import attempt
from rankmem.core.warnings import WarnOnce
from rankmem.forensics.replay import Addresses, replay
from rankmem.probe.device import DeviceBackend
from rankmem.windows import Where


def addresses(tracked: Iterable[tuple[Any, Any]], ptr: Callable[[Any], int] | None = None) -> Addresses:
    """Storage addresses of the parameters, gradients and optimizer state (of dimension >= 1: step
    counters are scalars) of ``(model, optimizer or None)`` pairs."""
    ptr = ptr or (lambda t: int(t.untyped_storage().data_ptr()))
    params = [p for model, _ in tracked for p in model.parameters()]
    state = [v for _, opt in tracked if opt is not None for s in opt.state.values() for v in s.values()]
    grads = [p.grad for p in params if p.grad is not None]
    return Addresses(frozenset(map(ptr, params)), frozenset(map(ptr, grads)),
                     frozenset(ptr(v) for v in state if getattr(v, "ndim", 0) >= 1))


class ModuleTags:
    """Global forward hooks that tag the allocations in each module's forward ``phase|fqn|fwd``
    (``infer`` under no_grad: nothing is kept for a backward), the enclosing module's tag after it."""

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
        leave = hooks.register_module_forward_hook(self._leave, always_call=True)  # first: it may fail
        self._handles = [leave, hooks.register_module_forward_pre_hook(self._enter)]
        self._set(f"{self._phase() or ''}||")

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
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


class HistorySampler:
    """This rank's sampled windows and OOM replays; ``write`` takes the ``anatomy`` events."""

    def __init__(self, device: DeviceBackend, write: Callable[[Event], object], where: Callable[[], Where], *,
                 every: int = 0, share: float | None = None, entries: int = 50_000, history: int = 0) -> None:
        self.device, self._write, self._where = device, write, where
        self.every, self.share, self.entries, self.history = every, share, entries, history
        self.tracked: list[tuple[Any, Any]] = []
        set_metadata = device.set_metadata_hook()
        self.tags = ModuleTags(set_metadata, lambda: where().phase) if set_metadata is not None else None
        self._steps, self._armed = 0, False
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
        """Arm the next step when this one's peak reached ``share`` of the device's capacity."""
        peak, total = local.get("mem/device/peak_allocated_gib"), local.get("mem/device/total_gib")
        if self.share is not None and peak is not None and total and peak >= self.share * total:
            self._armed = True

    def step(self, window: AbstractContextManager[None]) -> AbstractContextManager[None]:
        self._steps += 1
        if not self._armed and not (self.every and self._steps % self.every == 0):
            return window
        self._armed = False
        return self._sampled(window)

    @contextmanager
    def _sampled(self, window: AbstractContextManager[None]) -> Iterator[None]:
        recording = self.device.record_history(self.entries, clear=True)
        baseline = self.device.live_segments() if recording else None
        if baseline is not None and self.tags is not None:
            attempt(self.tags.install, default=None)  # a torch without always_call: no module tags
        try:
            with window:
                yield
        finally:
            try:
                if self.tags is not None:
                    self.tags.remove()
                snapshot = self.device.snapshot() if baseline is not None else None
                if recording:
                    self.device.record_history(self.history)  # back to oom_history's ring, or off
                if snapshot is not None:
                    self.replay_async(snapshot, baseline, self._where(), "sample")
            except Exception as exc:  # noqa: BLE001  (telemetry never raises into training)
                self._warn_once("sample", f"rankmem: sampling the allocator history failed ({exc!r})")

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
            found = replay(snapshot, baseline, owned, device=self.device.last_index or 0)
            extra = {"source": source, **found}
            self._write(Event(kind="anatomy", step=where.step, phase=where.phase, extra=extra))
        except Exception as exc:  # noqa: BLE001  (a snapshot of another torch's schema: named, never raised)
            self._warn_once("replay", f"rankmem: replaying the allocator history failed ({exc!r}); "
                            "no anatomy event")

    def close(self) -> None:
        """Wait for the replays (their events written before the event file closes)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
