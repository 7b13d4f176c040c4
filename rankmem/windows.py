"""Step and phase windows over the probe: edges, peak resets, peaks folded into every open window.

At every edge (a step or phase entering or leaving) the host and device peaks since the previous
edge are read into every open window and then reset, so a step's peak is the max over its phases and
the gaps between them. Until the first ``step()`` the window is "everything since the last
:meth:`Windows.take`". This layer is local to one rank: no torch.distributed, no files; what happens
when a window ends or fails is the :class:`WindowListener`'s business.

An edge is on the training thread, so it is kept to the kernel's reads plus a few Python calls: the
context manager *is* the window, the fold is inline, and the probe and the listener run in plain
``try`` blocks instead of guarded calls.
"""

from __future__ import annotations

import math
import operator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeVar

from rankmem.core.catalogue import PHASE_NAME
from rankmem.core.guard import Guard
from rankmem.core.records import DeviceReading, PhaseBytes, WindowBytes
from rankmem.errors import RankmemError
from rankmem.probe.device import DeviceBackend
from rankmem.probe.host import HostProbe
from rankmem.probe.nodewatch import NodeFigures

if TYPE_CHECKING:
    from rankmem.anatomy import Anatomy, _Run
    from rankmem.probe.nvmlwatch import DeviceAttribution

_N = TypeVar("_N", int, float)


class Where(NamedTuple):
    """Where this rank is: the open step (or the last one closed) and the innermost open phase. Made
    when asked (a failure, an event), not at the edges: they hand on the step and phase as they are."""

    step: int | None
    phase: str | None


class WindowListener(Protocol):
    """Told about edges and failures; it must not raise (the windows guard it)."""

    def edge(self, step: int | None, phase: str | None, rss: int | None, failing: bool = False) -> None:
        """After every edge, at ``step`` in the innermost open ``phase``: a heartbeat's chance to record
        progress (a few microseconds). ``failing``: the window is ending because an exception is leaving
        it (:meth:`failed` follows)."""

    def failed(self, exc: BaseException, where: Where, window: WindowBytes) -> None:
        """An exception left a window; ``window`` holds its figures up to that instant."""


_Carry = tuple[int | None, int | None, int | None, int | None, int | None]
"""The figures of the steps closed before this one since the last take: peak RSS, peak allocated, peak
reserved, allocation retries and OOMs."""
_Closed = tuple["_Window", int | None, DeviceReading | None, int | None, int | None]
"""A step as read at its closing edge: the window, RSS, device reading, lifetime peak RSS and reserved."""


class _Window:
    """An open window: its start values and its running max of the peaks seen between edges."""

    __slots__ = ("start_rss", "start_allocated", "start_reserved", "start_retries", "start_ooms", "peak_rss",
                 "peak_allocated", "peak_reserved", "work", "carry", "_windows", "_n", "_label", "_name")
    # Set by Windows.step() and Windows.phase() (no __init__: a call less per window).
    _windows: Windows
    _n: int | None
    _label: int | None
    _name: str

    def start(self, rss: int | None, dev: DeviceReading | None) -> None:
        """Open at an edge that read ``rss`` and ``dev``: they are the window's start and first point."""
        self.start_rss = self.peak_rss = rss
        self.work: Work | None = None
        self.carry: _Carry | None = None
        if dev is None:
            self.start_allocated = self.start_reserved = self.start_retries = self.start_ooms = None
            self.peak_allocated = self.peak_reserved = None
        elif dev.before_init:
            # A device without a context has allocated nothing and counted nothing: a window opened
            # before the first CUDA call still reports what happened in it (an OOM in step 0).
            self.start_allocated = self.start_reserved = self.start_retries = self.start_ooms = 0
            self.peak_allocated = self.peak_reserved = None
        else:
            self.start_allocated = self.peak_allocated = dev.allocated
            self.start_reserved = self.peak_reserved = dev.reserved
            self.start_retries, self.start_ooms = dev.alloc_retries, dev.ooms


class Work:
    """The micro-batches a window was told about: the heaviest by tokens (its tokens and sequences), the
    largest sum of squared lengths of any of them, and the totals.

    The two maxima may come from different micro-batches: with materialised attention the one with the
    longer sequences can set the peak while holding a few tokens fewer, and ``a + b*T + c*Q`` at both
    maxima bounds every micro-batch's peak, where the heaviest's own Q would not."""

    __slots__ = ("tokens", "sequences", "sq_tokens", "total_tokens", "count")

    def __init__(self) -> None:
        self.tokens = -1.0
        self.sequences: float | None = None
        self.sq_tokens: float | None = None
        self.total_tokens = 0.0
        self.count = 0

    def add(self, tokens: float, sequences: float | None, sq_tokens: float | None) -> None:
        if math.isnan(tokens):  # refused (Monitor.micro_batch): the window's work is unknown from here on
            self.tokens = self.total_tokens = math.nan
            return
        self.total_tokens += tokens
        self.count += 1
        if tokens > self.tokens:  # the first of equals stays: a few compares, no allocation
            self.tokens, self.sequences = tokens, sequences
        self.sq_tokens = _max(self.sq_tokens, sq_tokens)

    def into(self, p: PhaseBytes) -> None:
        """Fold into a phase's figures; a phase run twice in a step keeps the larger of each."""
        if p.mb_tokens is None or self.tokens > p.mb_tokens:
            p.mb_tokens, p.mb_sequences = self.tokens, self.sequences
        p.mb_sq_tokens = _max(p.mb_sq_tokens, self.sq_tokens)
        p.tokens = (p.tokens or 0.0) + self.total_tokens
        p.micro_batches = (p.micro_batches or 0.0) + self.count


class Windows:
    """This rank's windows over one host probe and one device backend (or none); the three are fixed
    at construction (the edge keeps their bound methods). ``attribution``, where there is one, adds
    its last split of device used by owner to every window taken."""

    def __init__(self, host: HostProbe, device: DeviceBackend | None, guard: Guard,
                 listener: WindowListener | None = None, attribution: DeviceAttribution | None = None,
                 node_refresh_s: float | None = None) -> None:
        self.host = host
        self.node = NodeFigures(lambda: host.read(False), node_refresh_s, guard)
        self.device = device
        self.listener = listener
        self.attribution = attribution
        self._guard = guard
        self._host_edge = host.edge
        self._listener_edge = listener.edge if listener is not None else None
        self._lifetime = _Window()
        self._lifetime.start(None, None)
        # Every window the peaks fold into: the lifetime first, then the open ones, outermost first.
        self._folded: list[_Window] = [self._lifetime]
        # The last step closed since the take, as read at its closing edge (the earlier ones are in its
        # carry): its figures are built at the take, not on the training thread's way out of every step.
        self._closed: _Closed | None = None
        self._phases: dict[str, PhaseBytes] = {}
        self._phase_stack: list[str] = []
        self._step: int | None = None
        self._phase: str | None = None  # the innermost open phase, kept current: every edge hands it on
        self._step_n: int | None = None  # what the next collect logs: the last numbered step closed, or set_step's
        self._collects = 0
        self._numbered = False  # a collect was given step=: the collect count is no step number then
        self._implicit: _Window | None = self._begin()
        self.anatomy: Anatomy | None = None
        """Set by Monitor.track(): phase peaks are then split (rankmem.anatomy), micro-batches are edges."""

    @property
    def where(self) -> Where:
        return Where(self._step, self._phase)

    # ---- edges --------------------------------------------------------------------------------------
    def _edge(self, failing: bool = False) -> tuple[int | None, DeviceReading | None]:
        """Fold the peaks since the last edge into every open window, reset them, tell the listener;
        the current values (None where the probe failed: telemetry never raises into training)."""
        rss = dev = None
        try:
            rss, peak = self._host_edge()
            if peak is None or (rss is not None and rss > peak):
                peak = rss  # the edge itself is a point of every window
            device = self.device
            if device is None:  # the host alone: the common CPU case, kept short
                if peak is not None:
                    for w in self._folded:
                        if w.peak_rss is None or peak > w.peak_rss:
                            w.peak_rss = peak
            else:
                dev = device.read()
                for w in self._folded:
                    w.peak_rss = _max(w.peak_rss, peak)
                    w.peak_allocated = _max(w.peak_allocated, dev.peak_allocated)
                    w.peak_reserved = _max(w.peak_reserved, dev.peak_reserved)
                device.reset_peaks()
        except RankmemError:
            raise
        except Exception as exc:  # noqa: BLE001
            self._guard.failed("edge", "memory probe failed, figures of this window are unavailable", exc)
        listener = self._listener_edge
        if listener is not None:
            try:
                listener(self._step, self._phase, rss, failing)
            except RankmemError:
                raise
            except Exception as exc:  # noqa: BLE001
                self._guard.failed("listener", "heartbeat failed", exc)
        return rss, dev

    def _begin(self) -> _Window:
        window = _Window()
        window.start(*self._edge())
        self._folded.append(window)
        return window

    def _end(self, window: _Window, failing: bool = False) -> tuple[int | None, DeviceReading | None]:
        rss, dev = self._edge(failing)
        if window in self._folded:
            self._folded.remove(window)
        return rss, dev

    def _failed(self, exc: BaseException, window: _Window, rss: int | None, dev: DeviceReading | None) -> None:
        if self.listener is not None and isinstance(exc, Exception):
            figures = _figures(window, rss, dev, self._lifetime.peak_rss, self._lifetime.peak_reserved)
            self._guard.call("failed", "recording the failure failed", self.listener.failed, exc, self.where,
                             figures, default=None)

    def micro_batch(self, tokens: float, sequences: float | None, sq_tokens: float | None) -> bool:
        """Tell the innermost open window about one micro-batch (numbers already checked). False when that
        window is no phase: only phases carry work keys."""
        if not self._phase_stack or len(self._folded) < 2:
            return False
        if self.anatomy is not None:  # the micro-batch before this one ends here
            self.boundary()
        window = self._folded[-1]
        if window.work is None:
            window.work = Work()
        window.work.add(tokens, sequences, sq_tokens)
        return True

    def boundary(self, grads: int | None = None, optional: bool = False) -> None:
        """An edge inside the open phases where a segment of their anatomy ends (a micro-batch, an optimizer
        step's start or end; ``optional``: see :meth:`Anatomy.ends`); ``grads``: the bytes, where counted."""
        anatomy = self.anatomy
        if anatomy is not None and anatomy.ends(grads, optional):
            self._edge()
            self._guard.call("anatomy", "peak anatomy failed", anatomy.boundary, grads, default=None)

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
        window = _Step()
        window._windows = self
        if n is not None:
            window._n = window._label = _step_number(n)  # at entry: a bad number must not replace the body's error
        else:
            window._n, window._label = None, self._collects if not self._numbered else None
        return window

    def set_step(self, n: int) -> None:
        """Name the step in progress (for the listener and failures, and the next collect) without
        opening a window."""
        self._step = self._step_n = _step_number(n)

    def phase(self, name: str) -> AbstractContextManager[None]:
        """A named phase: its own peaks and the RSS / allocated deltas across it."""
        if not isinstance(name, str) or not PHASE_NAME.match(name):
            raise RankmemError(f"phase name must match [A-Za-z0-9_.-]+ (it becomes part of metric keys); got {name!r}")
        window = _Phase()
        window._windows, window._name = self, name
        return window

    def _close_phase(self, name: str, window: _Window, rss: int | None, dev: DeviceReading | None,
                     run: _Run | None = None) -> None:
        p = self._phases.setdefault(name, PhaseBytes())
        if run is not None and self.anatomy is not None:  # this run's split, where it holds the phase's peak
            held, own = (p.peak_allocated, window.peak_allocated) if self.anatomy.device else (p.peak_rss,
                                                                                              window.peak_rss)
            if own is not None and (held is None or own >= held):
                self._guard.call("anatomy", "peak anatomy failed", self.anatomy.into, p, window, run, dev,
                                 default=None)
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
        if name == "sleep" and self.attribution is not None:
            self.attribution.asleep()  # what the engine holds asleep: mem/device/engine_residue_gib

    def take(self) -> tuple[WindowBytes, dict[str, PhaseBytes]]:
        """Close what ran since the last take: the merged steps, or (with no step closed) the implicit
        window; add the slow host figures (node, cgroup, children), read once here, and the device split."""
        closed = self._closed
        if closed is None:
            window = self._implicit if self._implicit is not None else self._begin()
            rss, dev = self._end(window)
            figures = _figures(window, rss, dev, self._lifetime.peak_rss, self._lifetime.peak_reserved)
            if self._implicit is not None:
                self._implicit = self._begin()
        else:
            figures = _figures(*closed)
        phases = self._phases
        self._closed, self._phases = None, {}
        # The node, cgroup and children figures (the closing edge has read this process's RSS and peak),
        # as the node thread last read them.
        node = self._guard.call("host", "host probe failed", self.node.read, default=None)
        if node is not None:
            figures.add_node(node[0])
            figures.node_age_s = node[1]
        if self.attribution is not None:  # the split its own thread took: no NVML call here
            self.attribution.fill(figures, phases)
        return figures, phases

    def close(self) -> None:
        """Stop the node thread and close the probe's descriptors (left open while a read is still
        running on that thread: closed, their numbers could go to another file it would then read)."""
        self.node.close(self.host.close)

    def discard(self) -> None:
        """Drop what was measured since the last take (after a failure while measuring)."""
        self._closed, self._phases = None, {}


class _Step(_Window):
    """``with windows.step(n):`` the window itself: an edge at each end, nothing built on the way."""

    __slots__ = ()

    def __enter__(self) -> None:
        windows = self._windows
        if windows._implicit is not None:
            windows._folded.remove(windows._implicit)
            windows._implicit = None
        windows._step = self._label
        self.start(*windows._edge())
        windows._folded.append(self)

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        windows = self._windows
        rss, dev = windows._edge(error is not None)
        folded = windows._folded
        if folded[-1] is self:  # the innermost open window, as it is unless a phase was left open in it
            folded.pop()
        elif self in folded:
            folded.remove(self)
        if error is not None:
            windows._failed(error, self, rss, dev)
        closed = windows._closed
        if closed is not None:  # several steps per collect: merged as they close, so nothing grows
            self.carry = _carry(closed)
        windows._closed = (self, rss, dev, windows._lifetime.peak_rss, windows._lifetime.peak_reserved)
        if self._n is not None:
            windows._step_n = self._n


class _Phase(_Window):
    """``with windows.phase(name):`` the edges at entry and exit both belong to the phase."""

    __slots__ = ()

    def __enter__(self) -> None:
        windows = self._windows
        windows._phase_stack.append(self._name)
        windows._phase = self._name
        try:
            self.start(*windows._edge())
        except BaseException:
            _pop_phase(windows)
            raise
        windows._folded.append(self)
        if windows.anatomy is not None:
            windows._guard.call("anatomy", "peak anatomy failed", windows.anatomy.open, self, default=None)
        if self._name == "wake" and windows.attribution is not None:
            windows.attribution.asleep()

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        windows = self._windows
        try:
            rss, dev = windows._edge(error is not None)
            if self in windows._folded:
                windows._folded.remove(self)
            if error is not None:
                windows._failed(error, self, rss, dev)
            anatomy = windows.anatomy
            run = None if anatomy is None else windows._guard.call("anatomy", "peak anatomy failed",
                                                                    anatomy.close, self, default=None)
            windows._close_phase(self._name, self, rss, dev, run)
        finally:
            _pop_phase(windows)


def _pop_phase(windows: Windows) -> None:
    stack = windows._phase_stack
    stack.pop()
    windows._phase = stack[-1] if stack else None


def _step_number(n: object) -> int:
    try:
        step = operator.index(n)  # type: ignore[arg-type]
    except TypeError:
        raise RankmemError(f"a step number must be an integer, got {n!r}") from None
    if not -(2**63) <= step < 2**63:  # the run log, heartbeat and events hold steps as int64
        raise RankmemError(f"a step number must fit in 64 bits, got {step}")
    return step


def _figures(window: _Window, rss: int | None, dev: DeviceReading | None, lifetime_rss: int | None,
             lifetime_reserved: int | None) -> WindowBytes:
    """A window's figures as read at its closing edge, merged with the steps it carries."""
    w = WindowBytes.of(None, dev)
    w.rss, w.peak_rss, w.lifetime_peak_rss = rss, window.peak_rss, lifetime_rss
    if dev is not None:
        w.peak_allocated, w.peak_reserved = window.peak_allocated, window.peak_reserved
        w.alloc_retries = _delta(dev.alloc_retries, window.start_retries)
        w.ooms = _delta(dev.ooms, window.start_ooms)
        w.lifetime_peak_reserved = lifetime_reserved
    if window.carry is not None:  # the max of the peaks, the sum of the events, the later current values
        peak_rss, peak_allocated, peak_reserved, retries, ooms = window.carry
        w.peak_rss = _max(peak_rss, w.peak_rss)
        w.peak_allocated = _max(peak_allocated, w.peak_allocated)
        w.peak_reserved = _max(peak_reserved, w.peak_reserved)
        w.alloc_retries, w.ooms = _sum(retries, w.alloc_retries), _sum(ooms, w.ooms)
    return w


def _carry(closed: _Closed) -> _Carry:
    """What a closed step (and the steps it carries) hands to the step that closes after it."""
    window, _, dev, _, _ = closed
    carry = window.carry
    if dev is None:  # no device figures at its edge: only the peak RSS is its own
        if carry is None:
            return window.peak_rss, None, None, None, None
        return _max(carry[0], window.peak_rss), carry[1], carry[2], carry[3], carry[4]
    own: _Carry = (window.peak_rss, window.peak_allocated, window.peak_reserved,
                   _delta(dev.alloc_retries, window.start_retries), _delta(dev.ooms, window.start_ooms))
    if carry is None:
        return own
    return (_max(carry[0], own[0]), _max(carry[1], own[1]), _max(carry[2], own[2]), _sum(carry[3], own[3]),
            _sum(carry[4], own[4]))


def _max(a: _N | None, b: _N | None) -> _N | None:
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
