"""Step and phase windows over the probe: edges, peak resets, peaks folded into every open window.

At every edge (a step or phase entering or leaving) the host and device peaks since the previous
edge are read into every open window and then reset, so a step's peak is the max over its phases and
the gaps between them, and the next step does not remember this one. Until the first ``step()`` the
window is "everything since the last :meth:`Windows.take`" (the implicit window).

This layer is local to one rank: no torch.distributed, no files. What happens when a window ends (a
heartbeat) or fails (an out-of-memory event) is the business of the :class:`WindowListener` passed in.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from rankmem.core.catalogue import PHASE_NAME
from rankmem.core.guard import Guard
from rankmem.core.records import DeviceReading, HostReading, PhaseBytes, WindowBytes
from rankmem.errors import RankmemError
from rankmem.probe.device import DeviceBackend
from rankmem.probe.host import HostProbe


@dataclass(frozen=True, slots=True)
class Where:
    """Where this rank is: the open step (or the last one closed) and the innermost open phase."""

    step: int | None
    phase: str | None


class WindowListener(Protocol):
    """Told about edges and failures; it must not raise (the Monitor guards it)."""

    def edge(self, where: Where, rss: int | None, failing: bool = False) -> None:
        """After every edge: a heartbeat's chance to record progress (a few microseconds).
        ``failing``: the window is ending because an exception is leaving it (:meth:`failed` follows)."""

    def failed(self, exc: BaseException, where: Where, window: WindowBytes) -> None:
        """An exception left a window; ``window`` holds its figures up to that instant."""


class _Open:
    """An open window: its start values and its running max of the peaks seen between edges."""

    __slots__ = ("start_rss", "start_allocated", "start_retries", "start_ooms", "peak_rss", "peak_allocated",
                 "peak_reserved")

    def __init__(self, rss: int | None, dev: DeviceReading | None) -> None:
        self.start_rss = rss
        self.start_allocated = dev.allocated if dev else None
        self.start_retries = dev.alloc_retries if dev else None
        self.start_ooms = dev.ooms if dev else None
        if dev is not None and dev.before_init:
            # A device without a context has allocated nothing and counted nothing: a window opened
            # before the first CUDA call still reports what happened in it (an OOM in step 0).
            self.start_allocated = self.start_retries = self.start_ooms = 0
        self.peak_rss: int | None = None
        self.peak_allocated: int | None = None
        self.peak_reserved: int | None = None

    def fold(self, rss: int | None, allocated: int | None, reserved: int | None) -> None:
        self.peak_rss = _max(self.peak_rss, rss)
        self.peak_allocated = _max(self.peak_allocated, allocated)
        self.peak_reserved = _max(self.peak_reserved, reserved)


class Windows:
    """This rank's windows over one host probe and one device backend (or none)."""

    def __init__(self, host: HostProbe, device: DeviceBackend | None, guard: Guard,
                 listener: WindowListener | None = None) -> None:
        self.host = host
        self.device = device
        self.listener = listener
        self._guard = guard
        self._open: list[_Open] = []
        self._lifetime = _Open(None, None)
        self._closed: WindowBytes | None = None  # steps closed since the last take(), merged
        self._phases: dict[str, PhaseBytes] = {}
        self._phase_stack: list[str] = []
        self._step: int | None = None
        self.step_n: int | None = None
        """The step number the next collect logs: the last numbered step closed, or :meth:`set_step`'s."""
        self._implicit: _Open | None = self._begin()
        # A collect adds the node, cgroup and children figures; the closing edge has read RSS and peak.
        self._read_node: Callable[[], HostReading] = getattr(host, "read_node", host.read)

    @property
    def where(self) -> Where:
        return Where(self._step, self._phase_stack[-1] if self._phase_stack else None)

    # ---- edges --------------------------------------------------------------------------------------
    def _edge(self) -> tuple[int | None, DeviceReading | None]:
        """Fold the peaks since the last edge into every open window, reset them; the current values."""
        rss, peak_rss = self.host.edge()
        dev = self.device.read() if self.device is not None else None
        peak_alloc = dev.peak_allocated if dev else None
        peak_res = dev.peak_reserved if dev else None
        peak_rss = _max(peak_rss, rss)  # the edge itself is a point of every window
        for w in self._open:
            w.fold(peak_rss, peak_alloc, peak_res)
        self._lifetime.fold(peak_rss, peak_alloc, peak_res)
        if self.device is not None:
            self.device.reset_peaks()
        return rss, dev

    def _safe_edge(self, failing: bool = False) -> tuple[int | None, DeviceReading | None]:
        unavailable: tuple[int | None, DeviceReading | None] = (None, None)
        reading = self._guard.call("edge", "memory probe failed, figures of this window are unavailable",
                                   self._edge, default=unavailable)
        if self.listener is not None:
            self._guard.call("listener", "heartbeat failed", self.listener.edge, self.where, reading[0], failing,
                             default=None)
        return reading

    def _begin(self) -> _Open:
        rss, dev = self._safe_edge()
        window = _Open(rss, dev)
        window.fold(rss, dev.allocated if dev else None, dev.reserved if dev else None)
        self._open.append(window)
        return window

    def _end(self, window: _Open, failing: bool = False) -> tuple[int | None, DeviceReading | None]:
        rss, dev = self._safe_edge(failing)
        if window in self._open:
            self._open.remove(window)
        return rss, dev

    def _bytes(self, window: _Open, rss: int | None, dev: DeviceReading | None) -> WindowBytes:
        w = WindowBytes.of(None, dev)
        w.rss, w.peak_rss, w.lifetime_peak_rss = rss, window.peak_rss, self._lifetime.peak_rss
        if dev is not None:
            w.peak_allocated, w.peak_reserved = window.peak_allocated, window.peak_reserved
            w.alloc_retries = _delta(dev.alloc_retries, window.start_retries)
            w.ooms = _delta(dev.ooms, window.start_ooms)
            w.lifetime_peak_reserved = self._lifetime.peak_reserved
        return w

    def _failed(self, exc: BaseException, window: _Open, rss: int | None, dev: DeviceReading | None) -> None:
        if self.listener is not None and isinstance(exc, Exception):
            figures = self._bytes(window, rss, dev)
            self._guard.call("failed", "recording the failure failed", self.listener.failed, exc, self.where,
                             figures, default=None)

    # ---- windows ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, n: int | None = None, label: int | None = None) -> Iterator[None]:
        """A step window. Steps closed before the next :meth:`take` merge (max peaks, summed events).
        ``label``: what the listener and failures call an unnumbered step (the collect it will be in)."""
        if n is not None:
            n = _step_number(n)  # at entry: a bad number must not replace the step body's own exception
        if self._implicit is not None:
            self._open.remove(self._implicit)
            self._implicit = None
        self._step = n if n is not None else label
        with self._window(lambda window, rss, dev: self._close_step(window, rss, dev, n)):
            yield

    def set_step(self, n: int) -> None:
        """Name the step in progress (for the listener and failures, and the next collect) without
        opening a window."""
        self._step = self.step_n = _step_number(n)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A named phase: its own peaks and the RSS / allocated deltas across it."""
        if not isinstance(name, str) or not PHASE_NAME.match(name):
            raise RankmemError(f"phase name must match [A-Za-z0-9_.-]+ (it becomes part of metric keys); got {name!r}")
        self._phase_stack.append(name)  # the edges at entry and exit both belong to this phase
        try:
            with self._window(lambda window, rss, dev: self._close_phase(name, window, rss, dev)):
                yield
        finally:
            self._phase_stack.pop()

    @contextlib.contextmanager
    def _window(self, close: Callable[[_Open, int | None, DeviceReading | None], None]) -> Iterator[None]:
        """Open a window; at its end read the edge, tell the listener about a failure, then ``close``."""
        window = self._begin()
        error: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            error = exc
            raise
        finally:
            rss, dev = self._end(window, error is not None)
            if error is not None:
                self._failed(error, window, rss, dev)
            close(window, rss, dev)

    def _close_step(self, window: _Open, rss: int | None, dev: DeviceReading | None, n: int | None) -> None:
        closed = self._bytes(window, rss, dev)
        self._closed = closed if self._closed is None else _merge(self._closed, closed)
        if n is not None:
            self.step_n = n

    def _close_phase(self, name: str, window: _Open, rss: int | None, dev: DeviceReading | None) -> None:
        p = self._phases.setdefault(name, PhaseBytes())
        # Inside an open phase of the same name (a helper that opens "update" called from "update"), the
        # outer one's delta spans this one's: summing both counted the growth twice. Peaks are a max.
        nested = name in self._phase_stack[:-1]
        p.peak_rss = _max(p.peak_rss, window.peak_rss)
        if not nested:
            p.rss_delta = _sum(p.rss_delta, _delta(rss, window.start_rss))
        if dev is not None:
            p.peak_allocated = _max(p.peak_allocated, window.peak_allocated)
            p.peak_reserved = _max(p.peak_reserved, window.peak_reserved)
            if not nested:
                p.allocated_delta = _sum(p.allocated_delta, _delta(dev.allocated, window.start_allocated))

    def take(self) -> tuple[WindowBytes, dict[str, PhaseBytes]]:
        """Close what ran since the last take: the merged steps, or (with no step closed) the implicit
        window; add the slow host figures (node, cgroup, children), read once here."""
        if self._closed is None:
            window = self._implicit if self._implicit is not None else self._begin()
            rss, dev = self._end(window)
            self._closed = self._bytes(window, rss, dev)
            if self._implicit is not None:
                self._implicit = self._begin()
        closed, phases = self._closed, self._phases
        self._closed, self._phases = None, {}
        host = self._guard.call("host", "host probe failed", self._read_node, default=None)
        if host is not None:
            closed.add_node(host)
        return closed, phases

    def discard(self) -> None:
        """Drop what was measured since the last take (after a failure while measuring)."""
        self._closed, self._phases = None, {}


def _step_number(n: object) -> int:
    try:
        step = operator.index(n)  # type: ignore[arg-type]
    except TypeError:
        raise RankmemError(f"a step number must be an integer, got {n!r}") from None
    if not -(2**63) <= step < 2**63:  # the run log, heartbeat and events hold steps as int64
        raise RankmemError(f"a step number must fit in 64 bits, got {step}")
    return step


def _max(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None or a >= b else b


def _sum(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else a + b


def _delta(end: int | None, start: int | None) -> int | None:
    return None if end is None or start is None else end - start


def _merge(earlier: WindowBytes, later: WindowBytes) -> WindowBytes:
    """Two consecutive windows as one: the max of the peaks, the sum of the event counts, and the
    later window's current values."""
    later.peak_rss = _max(earlier.peak_rss, later.peak_rss)
    later.peak_allocated = _max(earlier.peak_allocated, later.peak_allocated)
    later.peak_reserved = _max(earlier.peak_reserved, later.peak_reserved)
    later.alloc_retries = _sum(earlier.alloc_retries, later.alloc_retries)
    later.ooms = _sum(earlier.ooms, later.ooms)
    return later
