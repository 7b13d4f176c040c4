"""Forensics on every rank: the moment a rank runs out of memory, and the trail it leaves before.

- a heartbeat at every window edge (``rankmem train`` reads it after the kernel has killed the rank);
- an ``oom`` event when an out-of-memory error leaves a step or phase window, with the figures at that
  instant (on CUDA also the allocator observer's figures, and with ``oom_history`` a history snapshot);
- the node's near-OOM watch (the lowest local rank), which writes ``near_oom`` events;
- in every ``oom`` and ``near_oom`` event, the device used split by owner (``device.attribution``).

No collective and no device synchronisation on these paths, and nothing here may raise: the user's
exception goes on unchanged, and the facade's calls run inside the guard it is given.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from rankmem.core.events import Event, NearOomEvent, OomEvent
from rankmem.core.guard import Guard, attempt
from rankmem.core.records import WindowBytes
from rankmem.core.rundir import RunDir, open_regular
from rankmem.core.warnings import warn
from rankmem.exchange.dist import global_rank
from rankmem.forensics.events import EventWriter, oom_event, oom_where
from rankmem.forensics.heartbeat import Heartbeat, heartbeat_dir, heartbeat_run_id, node_siblings
from rankmem.forensics.nearoom import NearOomWatch
from rankmem.probe.device import DeviceBackend
from rankmem.probe.host import HostProbe
from rankmem.probe.pidmap import pid_view
from rankmem.windows import Where

if TYPE_CHECKING:  # a device's: loaded by the Monitor where it has one
    from rankmem.forensics.sampler import HistorySampler
    from rankmem.probe.nvmlwatch import DeviceAttribution
_RECORDED = "_rankmem_recorded"
"""Set on an exception once its ``oom`` event is written: it leaves several windows on its way out."""


def _recorded(exc: BaseException) -> bool:
    return getattr(exc, _RECORDED, False) is True


def _rotate_own(run_dir: RunDir, rank: int, run_id: str | None, beats: str | None) -> None:
    """This rank's files of an earlier run (a restart into the same directory) moved aside before it
    writes its own: the rest of that run's files follow when the logging rank opens the run log."""
    # The directories themselves too, where a plain file is in their place (it moves whole).
    own = [run_dir.event_file(rank), run_dir.events, run_dir.heartbeat]
    own += [run_dir.heartbeat_file(rank, beats)] if beats is not None else []
    try:
        run_dir.rotate(run_id, heartbeat_run_id, only=own)
    except OSError as exc:
        warn(f"rankmem: cannot move an earlier run's files aside in {run_dir.root} ({exc}); "
             "readers tell them apart by their run id")


class Forensics:
    """The Monitor's :class:`~rankmem.windows.WindowListener`: heartbeats, OOM events, near-OOM watch."""

    def __init__(self, out_dir: str | None, rank: int, host: HostProbe, device: DeviceBackend | None, *,
                 oom_history: int = 0, near_oom_watch: bool = True,
                 flush: Callable[[], object] | None = None, attribution: DeviceAttribution | None = None,
                 run_id: str | None = None, guard: Guard | None = None) -> None:
        self.rank = rank
        self._guard = guard if guard is not None else Guard()
        self._beat_scope = self._guard.scope("listener", "heartbeat failed")  # twice a collect: kept
        self._run_id = run_id
        self._host = host
        self._device = device
        self._attribution = attribution
        beats = heartbeat_dir(out_dir)
        if out_dir is not None and run_id is not None:
            _rotate_own(RunDir(out_dir), rank, run_id, beats)
        self._events = EventWriter(out_dir, rank, run_id) if out_dir is not None else None
        # Its host PID too, where /proc shows it: the sibling ranks' attribution joins NVML's PIDs by it.
        self._heartbeat = Heartbeat(beats, rank, run_id, pid_view().host_pid) if beats is not None else None
        self._history = max(int(oom_history), 0)
        self._hooked = device is None  # the observer and history wait for the backend's initialisation
        self._tag: tuple[int | None, str | None] | None = None
        self._step: int | None = None  # where the last edge was: the device's observer reads it
        self._phase: str | None = None
        self._observed: OomEvent | None = None  # what the allocator's observer saw, not yet written
        self._last_failure_id: int | None = None  # only where the exception takes no attribute
        self._snapshots = 0
        self._flush = flush
        self._watch: NearOomWatch | None = None
        self.sampler: HistorySampler | None = None  # replays each OOM snapshot (set by the Monitor on a device)
        if device is None and self._heartbeat is not None:
            # On the host alone an edge is its heartbeat (no observer, no history, no OOM to tag): the
            # windows call the heartbeat's own edge, a frame less on every edge of the training thread
            # (bench/bench_cold.py). ``_step`` and ``_phase`` serve only the device's observer.
            self.edge = self._heartbeat.edge  # type: ignore[method-assign]
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
        if near_oom_watch and self._events is not None and local_rank == 0:
            self._watch = NearOomWatch(self._near_oom, rank=rank, heartbeat_dir=beats).start()

    def adopt(self, run_id: str | None) -> None:
        """The run's id as the header says (the logging rank's), from now on in beats and events."""
        if run_id == self._run_id:
            return
        with self._guard.scope("forensics", "adopting the run id failed"):
            self._run_id = run_id
            if self._heartbeat is not None:
                self._heartbeat.adopt(run_id)
            if self._events is not None:
                self._events.run_id = run_id

    def collect_edge(self) -> None:
        """Entering or leaving a collect: the heartbeat tells a rank waiting in it from one that never came."""
        if self._heartbeat is not None:
            with self._beat_scope:
                self._heartbeat.collect_edge()

    # ---- WindowListener ----------------------------------------------------------------------------
    def edge(self, step: int | None, phase: str | None, rss: int | None, failing: bool = False) -> None:
        self._step, self._phase = step, phase
        if self._heartbeat is not None:
            self._heartbeat.edge(step, phase, rss)
        if self._device is not None:  # on the host alone an edge is its heartbeat
            self._device_edge(step, phase, failing)

    def _device_edge(self, step: int | None, phase: str | None, failing: bool) -> None:
        """The observer and history, once the device is initialised; an OOM the observer saw and the
        caller caught inside the window."""
        if not self._hooked:
            self._hook_device()
        if self._history and self._device is not None and (step, phase) != self._tag:
            self._tag = (step, phase)
            tag = self._device.set_metadata_hook()
            if tag is not None:
                attempt(tag, f"step {step} / {phase or '-'}", default=None)
        if self._observed is not None and not failing:
            # The allocator failed and the caller caught the error inside the window: still an event.
            observed, self._observed = self._observed, None
            self._write_oom(observed, None)

    def failed(self, exc: BaseException, where: Where, window: WindowBytes) -> None:
        if _recorded(exc) or id(exc) == self._last_failure_id or oom_where(exc) is None:
            return  # not an OOM, or already recorded by the window it left first (the innermost)
        # Marked, not kept: its traceback holds the failing frames (activations, the autograd graph),
        # which a caller that catches the OOM and retries smaller (auto_find_batch_size) needs freed.
        try:
            setattr(exc, _RECORDED, True)
        except (AttributeError, TypeError):
            self._last_failure_id = id(exc)
        host = self._host_figures(window)
        device = self._device_figures() if oom_where(exc) == "device" else None
        event = oom_event(exc, self.rank, where.step, where.phase, host, device)
        observed, self._observed = self._observed, None
        self._write_oom(event, observed)

    # ---- OOM ---------------------------------------------------------------------------------------
    def record(self, exc: BaseException, where: Where) -> None:
        """An OOM the caller caught outside any window (a framework's exception hook)."""
        with self._guard.scope("forensics", "recording the OOM failed"):
            self.failed(exc, where, WindowBytes())

    def _hook_device(self) -> None:
        device = self._device
        if device is None or not device.initialised():
            return
        # After CUDA is initialised, never before: observers attached earlier crash (pytorch#107330).
        self._hooked = True
        device.attach_oom_observer(self._observer)
        if self._history:
            device.record_history(self._history)

    def _observer(self, device: int, alloc: int, device_total: int, device_free: int) -> None:
        # Called by the allocator inside the failing allocation, before it raises: keep, do not write
        # yet (the exception leaving the window adds the window's figures to the same event).
        self._observed = OomEvent(
            rank=self.rank, step=self._step, phase=self._phase, where="device",
            observer={"device": device, "alloc_bytes": alloc, "device_total_bytes": device_total,
                      "device_free_bytes": device_free},
        )

    def _write_oom(self, event: OomEvent, observed: OomEvent | None) -> None:
        if observed is not None:
            seen = observed.observer or {}
            event = replace(event, observer=event.observer or seen,
                            requested_bytes=event.requested_bytes if event.requested_bytes is not None
                            else seen.get("alloc_bytes"))
        if event.where == "device" and self._attribution is not None:
            # The observer's event (an OOM caught inside the window) has no device figures of its own.
            event = replace(event, device={**(event.device or {}), "attribution": self._split()})
        if self._history and self._device is not None and self._events is not None:
            where = Where(event.step, event.phase)
            # The event matters more than its snapshot.
            event = replace(event, snapshot=attempt(self._write_snapshot, where, default=None))
        if self._events is not None:
            self._events.write(event)

    def _write_snapshot(self, where: Where) -> str | None:
        snapshot = self._device.snapshot() if self._device is not None else None
        if snapshot is None or self._events is None:
            return None
        self._snapshots += 1
        directory = os.path.dirname(self._events.path)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"rank{self.rank}-oom{self._snapshots}.pickle")
        fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        import pickle
        with os.fdopen(fd, "wb") as f:  # torch's _dump_snapshot format: pytorch.org/memory_viz reads it
            pickle.dump(snapshot, f)
        if self.sampler is not None:  # the top holders as the allocation failed, named off this thread
            self.sampler.replay_async(snapshot, None, where, "oom")
        return path

    def _host_figures(self, window: WindowBytes) -> dict[str, Any]:
        now = self._host.read()
        # The OOM killer weighs the working set (usage minus reclaimable file cache), not raw usage.
        charged = now.cgroup_working_set if now.cgroup_working_set is not None else now.cgroup_used
        cgroup_headroom = None if now.cgroup_limit is None or charged is None else now.cgroup_limit - charged
        return {"rss_bytes": now.rss if now.rss is not None else window.rss, "window_peak_rss_bytes": window.peak_rss,
                "node_available_bytes": now.node_available, "cgroup_limit_bytes": now.cgroup_limit,
                "cgroup_headroom_bytes": cgroup_headroom}

    def _device_figures(self) -> dict[str, Any] | None:
        if self._device is None:
            return None
        # memory_stats and cudaMemGetInfo do not synchronise the device; the snapshot of segments
        # is host-side allocator state.
        d = self._device.read()
        return {"allocated_bytes": d.allocated, "reserved_bytes": d.reserved, "inactive_split_bytes": d.inactive_split,
                "free_bytes": d.free, "total_bytes": d.total, "top_segments": self._device.segments(top=5)}

    def write_event(self, event: Event) -> None:  # from the replay thread too: one os.write a line
        if self._events is not None:
            self._events.write(event)

    # ---- near-OOM ----------------------------------------------------------------------------------
    def _split(self) -> dict[str, Any] | None:
        """The device split for an event: a fresh one where the thread gives it in time; None without NVML."""
        if self._attribution is None:
            return None
        split = attempt(self._attribution.fresh, 0.5, default=None)
        return split.to_event() if split is not None else None

    def _near_oom(self, info: NearOomEvent) -> None:
        if self._attribution is not None:
            info = replace(info, device={**(info.device or {}), "attribution": self._split()})
        if self._events is not None:
            self._events.write(info)
        if self._flush is not None:
            self._flush()  # the sinks' pending records reach disk before the OOM killer may strike

    def close(self, clean: bool = True) -> None:
        """Stop the near-OOM watch, close the heartbeat (``clean``: the process ends normally) and events."""
        with self._guard.scope("forensics", "closing the event files failed"):
            if self._watch is not None:
                self._watch.stop()
            if self._heartbeat is not None:
                self._heartbeat.close(clean)
            if self._events is not None:
                self._events.close()


ATTRIBUTION_OFF = "off (needs CUDA and nvml_refresh_s; a fake torch.cuda needs a fake NVML)"
"""What ``rankmem doctor`` shows where no attribution was built."""


def device_attribution(device: DeviceBackend | None, refresh_s: float | None, out_dir: str | None,
                       nvml_module: Any, where_now: Callable[[], Where]) -> DeviceAttribution | None:
    """The device used split by owner as a Monitor builds it, on CUDA: NVML's process list (the real
    ``torch.cuda`` with pynvml, or a fake pair) joined with this node's other ranks, which their
    heartbeats name (the probe may not import them); None elsewhere, or with ``refresh_s`` None."""
    real = device is not None and getattr(device.module, "__name__", None) == "torch.cuda"
    if device is None or device.name != "cuda" or refresh_s is None or (nvml_module is None and not real):
        return None  # a fake torch.cuda without a fake NVML: the real driver knows nothing of it
    from rankmem.probe.nvmlwatch import DeviceAttribution
    beats, rank = heartbeat_dir(out_dir), global_rank()

    def where() -> tuple[int | None, str | None]:
        try:  # read from the attribution thread while the training thread opens and closes phases
            w = where_now()
        except IndexError:  # the phase stack emptied between its test and its read
            return None, None
        return w.step, w.phase

    return DeviceAttribution(device, refresh_s, nvml_module=nvml_module, where=where,
                             siblings=lambda translated: node_siblings(beats, rank, translated))
