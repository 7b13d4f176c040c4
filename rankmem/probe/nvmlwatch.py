"""The device-attribution thread: every ``refresh_s`` seconds (and when an event asks), NVML's process
list of this rank's device, joined with this rank's PIDs, split by :func:`~rankmem.probe.attribution.split`.

The training thread never calls NVML: it only starts the thread (once the device has a context: before,
this process holds nothing and torch's figures are unknown) and picks up the last split, a few
attribute reads. Everything else (``nvmlInit``, the handle, the listing, the ``/proc`` joins, the
allocator figures for the same instant) runs here. The split is up to ``refresh_s`` old; an ``oom`` or
``near_oom`` event asks for a fresh one and waits a bounded time for it (:meth:`fresh`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from rankmem.core.catalogue import ATTRIBUTION_FIELDS
from rankmem.core.guard import Guard
from rankmem.core.records import PhaseBytes, WindowBytes
from rankmem.probe import nvml as _nvml
from rankmem.probe.attribution import Attribution, Owners, split
from rankmem.probe.device import DeviceBackend
from rankmem.probe.pidmap import NOT_MAPPED, PidView, pid_view

TRANSLATED = "translated (NVML reports this namespace's PIDs)"

Siblings = Callable[[bool], tuple[set[int], str | None]]
"""``siblings(translated)``: the host PIDs of this node's other ranks (their namespace PIDs when
``translated``), and why some are unknown (None: all known)."""
Where = Callable[[], tuple[int | None, str | None]]


class DeviceAttribution:
    """This rank's device split, refreshed on a daemon thread; see the module docstring."""

    def __init__(self, device: DeviceBackend, refresh_s: float, *, nvml_module: Any = None,
                 siblings: Siblings | None = None, where: Where | None = None, proc: str = "/proc") -> None:
        self._device = device
        self._refresh_s = refresh_s
        self._module = nvml_module
        self._siblings = siblings
        self._where = where
        self._proc = proc
        self._guard = Guard()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._done = threading.Condition()
        self._latest: Attribution | None = None
        self._samples = 0
        self.phase_descendants: dict[str, int] = {}
        """Per phase, the descendants' device memory when last seen in that phase."""
        self.residue: int | None = None
        """The descendants' device memory in the split taken as the engine went to sleep (:meth:`asleep`)."""
        self.status: str = "not started (the device has no context yet)"
        """What attribution does here, or why not: ``rankmem doctor`` and the docs say the same."""
        self.view: PidView | None = None
        """Wall time of recent process enumerations (seconds, the last 256)."""

    # ---- training thread: a few attribute reads ----------------------------------------------------
    def poll(self) -> Attribution | None:
        """Start the thread once the device has a context; the last split (None before the first)."""
        if self._thread is None and not self._stop.is_set() and self._device.last_index is not None:
            self._thread = threading.Thread(target=self._run, args=(self._device.last_index,),
                                            name="rankmem-nvml", daemon=True)
            self._thread.start()
        return self._latest

    def fill(self, window: WindowBytes, phases: Mapping[str, PhaseBytes]) -> None:
        """The last split into a closed window's figures, and each phase's descendants (no NVML call)."""
        split = self.poll()
        if split is not None:
            for name, part in ATTRIBUTION_FIELDS.items():
                setattr(window, name, getattr(split, part))
        window.engine_residue = self.residue
        for name, p in phases.items():
            p.device_descendants = self.phase_descendants.get(name)

    def asleep(self, timeout: float = 0.5) -> None:
        """The engine is asleep (a ``sleep`` phase ended, or a ``wake`` begins): the descendants' figure in
        a split listed from now on is its residue. Waits for the thread's split (an NVML listing, ~1 ms;
        at most ``timeout`` s, after which the residue keeps its last value): the next phase may wake it,
        and an engine's sleep or wake takes seconds."""
        asked = time.time()
        split = self.fresh(timeout)
        listed = split is not None and split.time - (split.cost_s or 0.0) >= asked
        if split is not None and listed and split.descendants is not None:
            self.residue = split.descendants

    # ---- any thread ---------------------------------------------------------------------------------
    def fresh(self, timeout: float = 0.5) -> Attribution | None:
        """A split taken after this call, waiting at most ``timeout`` s; else the last one (its
        ``time`` says how old), or None. The caller never calls NVML itself."""
        if self._thread is None or not self._thread.is_alive():
            return self._latest
        with self._done:
            seen = self._samples
            self._wake.set()
            self._done.wait_for(lambda: self._samples > seen or self._stop.is_set(), timeout)
        return self._latest

    def close(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ---- the attribution thread ---------------------------------------------------------------------
    def _run(self, index: int) -> None:
        stopped = self._guard.contain("nvml", "device attribution stopped")  # telemetry never kills training
        try:
            with stopped:
                self._serve(index)
            if stopped.error is not None:
                self.status = f"stopped: {stopped.error!r}"
        finally:
            with self._done:
                self._done.notify_all()

    def _serve(self, index: int) -> None:
        nvml_device = self._open(index)
        if nvml_device is None:
            return
        reader = DeviceBackend(self._device.name, self._device.module, index=index)
        # One bad sample (a process gone mid-read) costs that sample, not the thread.
        sample = self._guard.contain("sample", "a device attribution sample failed")
        while not self._stop.is_set():
            with sample:
                self._sample(nvml_device, reader)
            if sample.error is not None:
                with self._done:
                    self._samples += 1  # a waiting event gets the last split rather than a timeout
                    self._done.notify_all()
            self._wake.wait(self._refresh_s)
            self._wake.clear()

    def _open(self, index: int) -> _nvml.NvmlDevice | None:
        nvml, why = _nvml.load(self._module)
        if nvml is None:
            self.status = f"unavailable: {why}"
            return None
        device, why = _nvml.NvmlDevice.open(nvml, _nvml.uuid_candidates(self._device.module, index))
        if device is None:
            self.status = f"unavailable: {why}"
            return None
        self.view = pid_view(self._proc)
        self.status = f"on ({self.view.method}{', MIG' if device.mig else ''})"
        return device

    def _sample(self, device: _nvml.NvmlDevice, reader: DeviceBackend) -> None:
        step, phase = self._where() if self._where is not None else (None, None)
        start = time.perf_counter()
        listing = device.processes()
        cost = time.perf_counter() - start
        figures = reader.read()  # the allocator and mem_get_info at the same instant as the list
        owners = self._owners(listing.processes or [], figures.reserved)
        result = split(figures.used, figures.reserved, listing.processes, owners, refused=listing.refused,
                       time=time.time(), step=step, phase=phase, cost_s=cost)
        if phase is not None and result.descendants is not None:
            self.phase_descendants[phase] = result.descendants
        with self._done:
            self._latest = result
            self._samples += 1
            self._done.notify_all()

    def _owners(self, processes: list[tuple[int, int | None]], reserved: int | None) -> Owners:
        """Whose PIDs are whose: the ``/proc`` join, or the driver's own translation where it lists
        this process under its namespace PID (and with at least its torch reservation, so a host PID
        that merely equals ours is not taken for it)."""
        view = self.view
        assert view is not None
        listed = dict(processes)
        own = view.host_pid
        translated = False
        if own is None or own not in listed:
            mine = listed.get(view.own_pid)
            if view.own_pid in listed and (mine is None or reserved is None or mine >= reserved):
                own, translated = view.own_pid, True
        if own is None:
            return Owners(None, mapping=f"{NOT_MAPPED} (this container's /proc shows no host PID)")
        children = view.descendants()
        if translated:
            hosts, unmapped = set(children), 0
        else:
            mapped = [view.host_pid_of(pid) for pid in children]
            hosts, unmapped = {p for p in mapped if p is not None}, sum(p is None for p in mapped)
        sibling_pids, unknown = self._siblings(translated) if self._siblings is not None else (set(), None)
        return Owners(own, hosts, unmapped, sibling_pids - {own}, unknown,
                      mapping=TRANSLATED if translated else view.method)

