"""Step and phase windows over the probe: edges, peak resets, peaks folded into every open window.

At every edge (a step or phase entering or leaving) the host and device peaks since the previous
edge are read into every open window and then reset, so a step's peak is the max over its phases and
the gaps between them, and the next step does not remember this one. Until the first ``step()`` the
window is "everything since the last :meth:`Windows.take`" (the implicit window).

This layer is local to one rank: no torch.distributed, no files. What happens when a window ends (a
heartbeat) or fails (an out-of-memory event) is the business of the :class:`WindowListener` passed in.
"""

from __future__ import annotations

import operator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from rankmem.core.catalogue import PHASE_NAME
from rankmem.core.guard import Guard
from rankmem.core.records import DeviceReading, PhaseBytes, WindowBytes
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

    __slots__ = ("start_rss", "start_allocated", "start_reserved", "start_retries", "start_ooms", "peak_rss",
                 "peak_allocated", "peak_reserved", "work")

    def __init__(self, rss: int | None, dev: DeviceReading | None) -> None:
        self.start_rss = rss
        self.start_allocated = dev.allocated if dev else None
        self.start_reserved = dev.reserved if dev else None
        self.start_retries = dev.alloc_retries if dev else None
        self.start_ooms = dev.ooms if dev else None
        if dev is not None and dev.before_init:
            # A device without a context has allocated nothing and counted nothing: a window opened
            # before the first CUDA call still reports what happened in it (an OOM in step 0).
            self.start_allocated = self.start_reserved = self.start_retries = self.start_ooms = 0
        self.peak_rss: int | None = None
        self.peak_allocated: int | None = None
        self.peak_reserved: int | None = None
        self.work: Work | None = None

    def fold(self, rss: int | None, allocated: int | None, reserved: int | None) -> None:
        self.peak_rss = _max(self.peak_rss, rss)
        self.peak_allocated = _max(self.peak_allocated, allocated)
        self.peak_reserved = _max(self.peak_reserved, reserved)


class Work:
    """The micro-batches a window was told about: its heaviest (by tokens) and the totals."""

    __slots__ = ("tokens", "sequences", "sq_tokens", "total_tokens", "count")

    def __init__(self) -> None:
        self.tokens = -1.0
        self.sequences: float | None = None
        self.sq_tokens: float | None = None
        self.total_tokens = 0.0
        self.count = 0

    def add(self, tokens: float, sequences: float | None, sq_tokens: float | None) -> None:
        self.total_tokens += tokens
        self.count += 1
        if tokens > self.tokens:  # the first of equals stays: a few compares, no allocation
            self.tokens, self.sequences, self.sq_tokens = tokens, sequences, sq_tokens

    def into(self, p: PhaseBytes) -> None:
        """Fold into a phase's figures; a phase run twice in a step keeps the heavier micro-batch."""
        if p.mb_tokens is None or self.tokens > p.mb_tokens:
            p.mb_tokens, p.mb_sequences, p.mb_sq_tokens = self.tokens, self.sequences, self.sq_tokens
        p.tokens = (p.tokens or 0.0) + self.total_tokens
        p.micro_batches = (p.micro_batches or 0.0) + self.count


class Windows:
    """This rank's windows over one host probe and one device backend (or none)."""

    def __init__(self, host: HostProbe, device: DeviceBackend | None, guard: Guard,
                 listener: WindowListener | None = None) -> None:
        self.host = host
        self.device = device
        self.listener = listener
        self._guard = guard
        self._edge_scope = guard.scope("edge", "memory probe failed, figures of this window are unavailable")
        self._listener_scope = guard.scope("listener", "heartbeat failed")
        self._open: list[_Open] = []
        self._lifetime = _Open(None, None)
        # Steps closed since the last take(), as read at their closing edge: their figures are built
        # (and merged) at the take, not on the training thread's way out of every step.
        self._closed: list[WindowBytes | tuple[_Open, int | None, DeviceReading | None, int | None, int | None]] = []
        self._phases: dict[str, PhaseBytes] = {}
        self._phase_stack: list[str] = []
        self._where: Where | None = None
        self._step: int | None = None
        self._step_n: int | None = None  # what the next collect logs: the last numbered step closed, or set_step's
        self._collects = 0
        self._numbered = False  # a collect was given step=: the collect count is no step number then
        self._implicit: _Open | None = self._begin()

    @property
    def where(self) -> Where:
        # Rebuilt only when the step or phase changes: every edge hands it to the listener.
        where = self._where
        phase = self._phase_stack[-1] if self._phase_stack else None
        if where is None or where.step != self._step or where.phase is not phase:
            where = self._where = Where(self._step, phase)
        return where

    # ---- edges --------------------------------------------------------------------------------------
    def _edge(self) -> tuple[int | None, DeviceReading | None]:
        """Fold the peaks since the last edge into every open window, reset them; the current values."""
        rss, peak_rss = self.host.edge()
        peak_rss = _max(peak_rss, rss)  # the edge itself is a point of every window
        if self.device is None:  # the host alone: the common CPU case, kept short
            if peak_rss is not None:
                for w in (*self._open, self._lifetime):
                    if w.peak_rss is None or peak_rss > w.peak_rss:
                        w.peak_rss = peak_rss
            return rss, None
        dev = self.device.read()
        peak_alloc, peak_res = dev.peak_allocated, dev.peak_reserved
        for w in self._open:
            w.fold(peak_rss, peak_alloc, peak_res)
        self._lifetime.fold(peak_rss, peak_alloc, peak_res)
        self.device.reset_peaks()
        return rss, dev

    def _safe_edge(self, failing: bool = False) -> tuple[int | None, DeviceReading | None]:
        reading: tuple[int | None, DeviceReading | None] = (None, None)
        with self._edge_scope:
            reading = self._edge()
        if self.listener is not None:
            with self._listener_scope:
                self.listener.edge(self.where, reading[0], failing)
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

    def _bytes(self, window: _Open, rss: int | None, dev: DeviceReading | None,
               lifetime_rss: int | None, lifetime_reserved: int | None) -> WindowBytes:
        w = WindowBytes.of(None, dev)
        w.rss, w.peak_rss, w.lifetime_peak_rss = rss, window.peak_rss, lifetime_rss
        if dev is not None:
            w.peak_allocated, w.peak_reserved = window.peak_allocated, window.peak_reserved
            w.alloc_retries = _delta(dev.alloc_retries, window.start_retries)
            w.ooms = _delta(dev.ooms, window.start_ooms)
            w.lifetime_peak_reserved = lifetime_reserved
        return w

    def _bytes_now(self, window: _Open, rss: int | None, dev: DeviceReading | None) -> WindowBytes:
        return self._bytes(window, rss, dev, self._lifetime.peak_rss, self._lifetime.peak_reserved)

    def _failed(self, exc: BaseException, window: _Open, rss: int | None, dev: DeviceReading | None) -> None:
        if self.listener is not None and isinstance(exc, Exception):
            figures = self._bytes_now(window, rss, dev)
            self._guard.call("failed", "recording the failure failed", self.listener.failed, exc, self.where,
                             figures, default=None)

    def micro_batch(self, tokens: float, sequences: float | None, sq_tokens: float | None) -> bool:
        """Tell the innermost open window about one micro-batch (numbers already checked). False when that
        window is no phase: only phases carry work keys."""
        if not self._phase_stack or not self._open:
            return False
        window = self._open[-1]
        if window.work is None:
            window.work = Work()
        window.work.add(tokens, sequences, sq_tokens)
        return True

    # ---- windows ------------------------------------------------------------------------------------
    def next_step(self, given: int | None) -> tuple[int, bool]:
        """The step number a collect logs, and whether it was stated (``given``, a numbered step or
        :meth:`set_step`) rather than counted; called once per collect."""
        self._numbered = self._numbered or given is not None
        stated = given is not None or self._step_n is not None
        if given is None:
            given = self._step_n if self._step_n is not None else self._collects
        self._step_n = None
        self._collects += 1
        return given, stated

    def step(self, n: int | None = None) -> AbstractContextManager[None]:
        """A step window. Steps closed before the next :meth:`take` merge (max peaks, summed events).
        Unnumbered, the listener and failures call it by the collect it will be in (unknown where
        collects are numbered with ``step=``)."""
        if n is not None:
            n = _step_number(n)  # at entry: a bad number must not replace the step body's own exception
        return _StepWindow(self, n, self._collects if n is None and not self._numbered else None)

    def set_step(self, n: int) -> None:
        """Name the step in progress (for the listener and failures, and the next collect) without
        opening a window."""
        self._step = self._step_n = _step_number(n)

    def phase(self, name: str) -> AbstractContextManager[None]:
        """A named phase: its own peaks and the RSS / allocated deltas across it."""
        if not isinstance(name, str) or not PHASE_NAME.match(name):
            raise RankmemError(f"phase name must match [A-Za-z0-9_.-]+ (it becomes part of metric keys); got {name!r}")
        return _PhaseWindow(self, name)

    def _enter_step(self, label: int | None) -> _Open:
        if self._implicit is not None:
            self._open.remove(self._implicit)
            self._implicit = None
        self._step = label
        return self._begin()

    def _exit(self, window: _Open, error: BaseException | None) -> tuple[int | None, DeviceReading | None]:
        """A window's end: read the edge, tell the listener about a failure."""
        rss, dev = self._end(window, error is not None)
        if error is not None:
            self._failed(error, window, rss, dev)
        return rss, dev

    def _close_step(self, window: _Open, rss: int | None, dev: DeviceReading | None, n: int | None) -> None:
        if self._closed:  # several steps per collect: merged as they close, so nothing grows
            earlier = self._closed[0]
            merged = earlier if isinstance(earlier, WindowBytes) else self._bytes(*earlier)
            self._closed[0] = _merge(merged, self._bytes(window, rss, dev, self._lifetime.peak_rss,
                                                         self._lifetime.peak_reserved))
        else:
            self._closed.append((window, rss, dev, self._lifetime.peak_rss, self._lifetime.peak_reserved))
        if n is not None:
            self._step_n = n

    def _close_phase(self, name: str, window: _Open, rss: int | None, dev: DeviceReading | None) -> None:
        p = self._phases.setdefault(name, PhaseBytes())
        # A phase run twice in a step: the peak, and the rise of the run that reached it (a run that only
        # held a peak an earlier run raised must not hide that rise, nor lend its own to a lower peak).
        # Inside an open phase of the same name (a helper that opens "update" called from "update"), the
        # outer one's delta spans this one's: summing both counted the growth twice. Peaks are a max.
        nested = name in self._phase_stack[:-1]
        p.peak_rss, p.peak_rss_rise = _peak_and_rise(p.peak_rss, p.peak_rss_rise, window.peak_rss, window.start_rss)
        if not nested:
            p.rss_delta = _sum(p.rss_delta, _delta(rss, window.start_rss))
        if dev is not None:
            p.peak_allocated, p.peak_allocated_rise = _peak_and_rise(
                p.peak_allocated, p.peak_allocated_rise, window.peak_allocated, window.start_allocated)
            p.peak_reserved, p.peak_reserved_rise = _peak_and_rise(
                p.peak_reserved, p.peak_reserved_rise, window.peak_reserved, window.start_reserved)
            if not nested:
                p.allocated_delta = _sum(p.allocated_delta, _delta(dev.allocated, window.start_allocated))
        if window.work is not None:
            window.work.into(p)

    def take(self) -> tuple[WindowBytes, dict[str, PhaseBytes]]:
        """Close what ran since the last take: the merged steps, or (with no step closed) the implicit
        window; add the slow host figures (node, cgroup, children), read once here."""
        if not self._closed:
            window = self._implicit if self._implicit is not None else self._begin()
            rss, dev = self._end(window)
            closed = self._bytes_now(window, rss, dev)
            if self._implicit is not None:
                self._implicit = self._begin()
        else:
            first = self._closed[0]
            closed = first if isinstance(first, WindowBytes) else self._bytes(*first)
        phases = self._phases
        self._closed, self._phases = [], {}
        # The node, cgroup and children figures; the closing edge has read this process's RSS and peak.
        host = self._guard.call("host", "host probe failed", self.host.read, False, default=None)
        if host is not None:
            closed.add_node(host)
        return closed, phases

    def discard(self) -> None:
        """Drop what was measured since the last take (after a failure while measuring)."""
        self._closed, self._phases = [], {}


class _StepWindow:
    """``with windows.step(n):`` one object per window, no generator: an edge at each end."""

    __slots__ = ("_windows", "_n", "_label", "_window")

    def __init__(self, windows: Windows, n: int | None, label: int | None) -> None:
        self._windows, self._n, self._label = windows, n, label

    def __enter__(self) -> None:
        self._window = self._windows._enter_step(self._n if self._n is not None else self._label)

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        windows = self._windows
        rss, dev = windows._exit(self._window, error)
        windows._close_step(self._window, rss, dev, self._n)


class _PhaseWindow:
    """``with windows.phase(name):`` the edges at entry and exit both belong to the phase."""

    __slots__ = ("_windows", "_name", "_window")

    def __init__(self, windows: Windows, name: str) -> None:
        self._windows, self._name = windows, name

    def __enter__(self) -> None:
        windows = self._windows
        windows._phase_stack.append(self._name)
        try:
            self._window = windows._begin()
        except BaseException:
            windows._phase_stack.pop()
            raise

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        windows = self._windows
        try:
            rss, dev = windows._exit(self._window, error)
            windows._close_phase(self._name, self._window, rss, dev)
        finally:
            windows._phase_stack.pop()


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


def _peak_and_rise(peak: int | None, rise: int | None, run_peak: int | None,
                   run_start: int | None) -> tuple[int | None, int | None]:
    """A phase's (peak, rise to it) after one more run of it with ``run_peak`` from ``run_start``."""
    run_rise = _delta(run_peak, run_start)
    if run_peak is None:
        return peak, rise
    if peak is None or run_peak > peak:
        return run_peak, run_rise
    if run_peak == peak:
        return peak, _max(rise, run_rise)
    return peak, rise


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
