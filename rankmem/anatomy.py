"""Peak anatomy: what fills each phase's peak on this rank (docs/anatomy.md).

:class:`Tracker` holds what :meth:`rankmem.Monitor.track` was told (models, optimizers) and reads it cheaply:
parameter bytes once (storages deduplicated; a DTensor's local shard), optimizer state bytes after a step
that changed the state's shape, gradient bytes (sizes cached) by one pass over the parameters where some
may have appeared or gone: not after a tracked optimizer's ``zero_grad`` (wrapped), nor while all are held.
:class:`Anatomy` cuts each open phase into segments at the boundaries the monitor sees (its edges, each
``micro_batch()``, an optimizer step's start and end) and remembers the gradients and optimizer state at the
ends of the segment in which the phase's peak was reached. Local to one rank; nothing here imports torch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from functools import partial, update_wrapper
from itertools import compress, repeat
from operator import attrgetter, is_not
from types import SimpleNamespace
from typing import Any

from rankmem.core.guard import Guard
from rankmem.core.records import DeviceReading, PhaseBytes

_GRAD = attrgetter("grad")


def _local(t: Any) -> Any:
    """A DTensor's local shard (what this rank holds); any other tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


class Tracker:
    """The tracked models and optimizers, counted on one device type (``cuda``, ``cpu``, ...): tensors
    elsewhere (an optimizer offloaded to the host) are not in that device's peak."""

    def __init__(self, kind: str, guard: Guard, boundary: Callable[[int | None, bool], None]) -> None:
        self.kind = kind
        self.params_bytes = 0
        self.optimizer_bytes: int | None = None
        """None until an optimizer is tracked: its state is then unknown, not 0."""
        self.drops = 0
        """How often a gradient set was freed (``zero_grad(set_to_none=True)``), seen by a weak reference."""
        self.full_grads = 0
        """The most gradient bytes seen at an optimizer step's start."""
        self.boundary: Callable[[int | None, bool], None] | None = boundary
        """Called at an optimizer step's start (with the gradient bytes) and end (the same bytes); the flag:
        the start, where the step cannot grow the optimizer state (:meth:`Anatomy.ends`)."""
        self._guard = guard
        self._seen: set[int] = set()
        self._storages: set[int] = set()
        self._grad_params: list[Any] = []
        self._grad_sizes: list[int] = []
        self._optimizers: list[Any] = []
        self._covers: dict[int, bool] = {}  # by the optimizer's id: it holds every tracked parameter
        self._state_shape: tuple[tuple[int, int], ...] = ()
        self._step_grads = 0
        self._sentinel: weakref.ref[Any] | None = None
        self._handles: list[Any] = []
        import torch  # track() was given torch objects: it is imported already

        # The autograd nodes this thread has made: unchanged, no graph was built whose backward could have made
        # gradients since the last walk. A backward of an older graph shows on one watched parameter: its
        # gradient made, or accumulated into (its version). A private call: without it, every boundary walks.
        self._graphs: Callable[[], object] = getattr(torch._C._autograd, "_get_sequence_nr", object)
        self._seen_at: tuple[object, int, int | None] = (None, -1, None)
        self._last = self._full = 0
        self._watched: Any = None

    def add(self, model: Any, optimizer: Any = None) -> None:
        for p in model.parameters():
            if id(p) in self._seen:  # tied weights, or the same model tracked twice
                continue
            self._seen.add(id(p))
            t = _local(p)
            if t.device.type != self.kind:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._storages:
                self._storages.add(storage.data_ptr())
                self.params_bytes += int(storage.nbytes())
            if p.requires_grad:
                self._watched = p if self._watched is None else self._watched
                self._grad_params.append(p)
                self._grad_sizes.append(int(t.nbytes))
        if optimizer is not None and all(o is not optimizer for o in self._optimizers):
            self._optimizers.append(optimizer)
            self._handles += [optimizer.register_step_pre_hook(partial(self._hook, True)),
                              optimizer.register_step_post_hook(partial(self._hook, False))]
            if "zero_grad" not in vars(optimizer):  # not wrapped already, by whoever: then walk after it
                optimizer.zero_grad = update_wrapper(partial(self._zero_grad, optimizer.zero_grad, id(optimizer)),
                                                     optimizer.zero_grad)
                self._handles.append(SimpleNamespace(remove=partial(vars(optimizer).pop, "zero_grad", None)))
            self._read_optimizer(force=True)
        ids, self._full = set(map(id, self._grad_params)), sum(self._grad_sizes)
        self._covers = {id(o): ids <= {id(p) for g in o.param_groups for p in g["params"]} for o in self._optimizers}

    def grads(self, fresh: bool = False) -> int:
        """Bytes of the gradients alive now: one pass over the parameters (C-level iteration, ~0.1 us a tensor),
        skipped where no graph was built and none freed since the last, or all were held then and none freed."""
        watched = None if self._watched is None else self._watched.grad
        at = (self._graphs(), self.drops, None if watched is None else watched._version)
        if not fresh and (at == self._seen_at or self._last == self._full and at[1] == self._seen_at[1]):
            return self._last
        total = sum(compress(self._grad_sizes, map(is_not, map(_GRAD, self._grad_params), repeat(None))))
        if total and self._sentinel is None:
            self._sentinel = weakref.ref(next(g for g in map(_GRAD, self._grad_params) if g is not None), self._dropped)
        self._seen_at, self._last = at, total
        return total

    def _dropped(self, _: object) -> None:
        self.drops += 1
        self._sentinel = None

    def _zero_grad(self, zero_grad: Callable[..., Any], optimizer: int, *args: Any, **kwargs: Any) -> Any:
        """A tracked optimizer's ``zero_grad``: where it holds every tracked parameter and freed the watched
        one's gradient (``set_to_none``), none is left; elsewhere it counts as a free (the next read walks)."""
        had = self._watched is not None and self._watched.grad is not None
        out = zero_grad(*args, **kwargs)
        if not self._covers.get(optimizer):  # it may have freed gradients the sentinel does not see
            self.drops += 1
        elif had and self._watched.grad is None:  # the sentinel has seen the free: the signature the next read sees
            self._seen_at, self._last = (self._graphs(), self.drops, None), 0
        return out

    def _read_optimizer(self, force: bool = False) -> None:
        """Optimizer state bytes (tensors of dimension >= 1), read again only when the state changed shape:
        it appears at the first step and then stays (a walk is ~1 us per tensor)."""
        shape = tuple((id(o.state), len(o.state)) for o in self._optimizers)
        if shape == self._state_shape and not force:
            return
        self._state_shape = shape
        self.optimizer_bytes = sum(int(t.nbytes) for t in self._states())

    def _states(self) -> Iterator[Any]:
        """The optimizers' state tensors of dimension >= 1 on this device type (a DTensor's local shard)."""
        return (_local(v) for o in self._optimizers for s in o.state.values() for v in s.values()
                if hasattr(v, "untyped_storage") and v.dim() >= 1 and _local(v).device.type == self.kind)

    def _hook(self, start: bool, *_: Any) -> None:
        self._guard.call("anatomy", "peak anatomy failed at a step", self._step_edge, start, default=None)

    def _step_edge(self, start: bool) -> None:
        if start:
            self._step_grads = self.grads()
            self.full_grads = max(self.full_grads, self._step_grads)
        else:
            self._read_optimizer()  # a step reads gradients, it does not free them
        settled = all(len(o.state) == sum(len(g["params"]) for g in o.param_groups) for o in self._optimizers)
        if self.boundary is not None:
            self.boundary(self._step_grads, start and settled)

    def ptrs(self) -> dict[str, set[int]]:
        """The ``data_ptr()`` of every tracked storage on this device type, by category (``params``, ``grads``,
        ``optimizer``): what an allocator history's blocks are classed by. A walk: not for the hot path."""
        grads = {_local(p.grad).untyped_storage().data_ptr() for p in self._grad_params if p.grad is not None}
        optimizer = {t.untyped_storage().data_ptr() for t in self._states()}
        return {"params": set(self._storages), "grads": grads, "optimizer": optimizer}

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.boundary = None


class _Run:
    """One run of a phase: the segment now open and the one in which the peak was reached."""

    __slots__ = ("g0", "drops", "last_peak", "start", "best")

    def __init__(self, g: int, drops: int, peak: int | None, optimizer: int | None) -> None:
        self.g0, self.drops, self.last_peak = g, drops, peak
        self.start = (g, optimizer)
        self.best: tuple[int, int, int | None] | None = None
        """(gradients low, high, optimizer bytes) of the segment that raised the peak; None: the peak is
        the phase's start."""


class Anatomy:
    """The segments of every open phase window and the split of each phase's peak. ``device``: split the
    allocator's peak (``peak_allocated``); otherwise the host's (``peak_rss``)."""

    def __init__(self, tracker: Tracker, device: bool) -> None:
        self.tracker = tracker
        self.device = device
        self._runs: dict[object, _Run] = {}

    def _peak(self, window: Any) -> int | None:
        return window.peak_allocated if self.device else window.peak_rss  # type: ignore[no-any-return]

    def open(self, window: Any) -> None:
        t = self.tracker
        self._runs[window] = _Run(t.grads(), t.drops, self._peak(window), t.optimizer_bytes)

    def ends(self, g: int | None, optional: bool) -> bool:
        """Whether an edge here ends a segment: not where none is open, nor where ``optional`` and no open one
        saw its gradients made or freed (it would split nothing: the same range and state)."""
        return bool(self._runs) and not (optional and all(r.g0 == g and r.drops == self.tracker.drops
                                                          for r in self._runs.values()))

    def boundary(self, g: int | None = None) -> None:
        """After an edge that folded the peaks into every open window: a segment ends in each."""
        if g is None:
            g = self.tracker.grads()
        for window, run in self._runs.items():
            self._advance(window, run, g)

    def _advance(self, window: Any, run: _Run, g: int) -> None:
        t = self.tracker
        peak = self._peak(window)
        if peak is not None and (run.last_peak is None or peak > run.last_peak):
            # Between two frees of the gradients they only grow, so the segment's ends bound them; a free
            # inside the segment (zero_grad) puts the low end at 0 and the high end at a full set.
            if t.drops != run.drops:
                run.best = (0, max(run.g0, g, t.full_grads), t.optimizer_bytes)
            else:
                run.best = (run.g0, max(run.g0, g), t.optimizer_bytes)
        run.last_peak, run.g0, run.drops = peak, g, t.drops

    def close(self, window: Any) -> _Run | None:
        """The phase's closing edge is a boundary of its own; the run, for :meth:`into`."""
        run = self._runs.pop(window, None)
        if run is not None:
            self._advance(window, run, self.tracker.grads())
        return run

    def into(self, p: PhaseBytes, window: Any, run: _Run, dev: DeviceReading | None) -> None:
        """The split of this run's peak into ``p``: called when the run holds the phase's peak."""
        peak = self._peak(window)
        if peak is None:
            return
        t = self.tracker
        start_grads, start_optimizer = run.start
        # No segment raised the peak: it is the phase's start, where the gradients are known.
        low, high, optimizer = run.best or (start_grads, start_grads, start_optimizer)
        held = t.params_bytes + (optimizer or 0) + high
        if self.device:
            known = dev is not None and dev.used is not None and dev.reserved is not None
            other = max(dev.used - dev.reserved, 0) if known else None  # type: ignore[operator,union-attr]
            slack = None if window.peak_reserved is None else window.peak_reserved - peak
        else:
            # The host: the resident process below the tracked state at the phase's start (interpreter,
            # libraries, data, heap kept from before) is its own figure; what rose above it is the phase's.
            start_rss = window.start_rss
            tracked = t.params_bytes + (start_optimizer or 0) + start_grads
            other = None if start_rss is None else max(0, min(start_rss - tracked, peak - held))
            slack = None
        p.anatomy_params, p.anatomy_optimizer = t.params_bytes, optimizer
        p.anatomy_grads_low, p.anatomy_grads_high = low, high
        p.anatomy_activations = max(0, peak - held - (0 if self.device else other or 0))
        p.anatomy_slack, p.anatomy_other = slack, other
