"""The Monitor: the facade that wires the layers together on every rank.

    probe (probe/) -> windows (windows.py) -> exchange (exchange/) -> publish (publish/, sinks/)

Build one on every rank after ``init_process_group``::

    monitor = rankmem.Monitor(out_dir="runs/demo", sinks=("jsonl", "console"))
    for step in range(steps):
        with monitor.step(step):
            with monitor.phase("rollout"):
                ...
        metrics = monitor.collect({"loss": loss})  # a collective: every rank calls it
    monitor.close()
"""

from __future__ import annotations

import copy
import math
import numbers
import operator
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from typing import Any

from rankmem.core.catalogue import ATTRIBUTION_FIELDS, phase_metrics, verl_metrics, window_metrics
from rankmem.core.guard import Guard
from rankmem.core.records import PhaseBytes, RunHeader, StepRecord, WindowBytes
from rankmem.core.scalars import scalar_items
from rankmem.errors import RankmemError
from rankmem.exchange.aggregate import Gathered
from rankmem.exchange.dist import dist_active, global_rank, launcher_world, rank_and_world
from rankmem.exchange.exchange import Exchange, run_header
from rankmem.forensics.forensics import Forensics
from rankmem.forensics.heartbeat import heartbeat_dir, node_siblings
from rankmem.probe.device import DeviceBackend, select_backend
from rankmem.probe.host import PEAK_SOURCES, HostProbe, make_host_probe, peak_source_default
from rankmem.probe.nvmlwatch import DeviceAttribution
from rankmem.publish.publisher import Publisher
from rankmem.sinks import Sink, check_sink_specs, make_sink
from rankmem.windows import Where, Windows


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """How a :class:`Monitor` measures and where it writes. Validated on construction."""

    device: str = "auto"
    """Device backend: ``auto`` (cuda, npu, xpu, in that order, if available), a backend name, or ``cpu``."""
    sinks: Sequence[str | Sink] | None = None
    """Sink names (``console``, ``jsonl``/``file``, ``tensorboard``, ``wandb``, ``mlflow``, ``prometheus``) or sink objects.
    Default: the run log (``jsonl``) when ``out_dir`` is set, nothing otherwise."""
    sink_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Keyword options of named sinks, by name: ``{"prometheus": {"port": 9465, "top_k": 3}}``."""
    out_dir: str | None = None
    """Run directory for file-backed sinks (the run log is ``<out_dir>/rankmem.jsonl``)."""
    log_rank: int = 0
    """The rank (in the monitor's group) that writes sinks; every rank still measures."""
    children: bool = True
    """Measure the RSS of descendant processes (dataloader workers)."""
    children_refresh_s: float = 5.0
    """Seconds between re-listings of descendant processes; their RSS is read on every collect."""
    verl_keys: bool = True
    """Also return verl's ``perf/*`` memory keys with their corrected meaning."""
    run_config: dict[str, Any] = field(default_factory=dict)
    """The caller's own configuration, stored in the run log header."""
    leak_check: bool = True
    """On the logging rank, test host RSS / device allocated / worker RSS for steady growth; warn once."""
    oom_history: int = 0
    """On CUDA, keep a ring of this many allocator events (Python stacks, tagged with step and phase) and
    write a snapshot file next to each ``oom`` event; 0 (default) records none. Costs GPU-side time per
    allocation: see bench/RESULTS.md."""
    near_oom_watch: bool = True
    """With ``out_dir`` set, the lowest local rank of each node polls cgroup / node headroom and memory
    pressure every 0.2 s on a thread and writes a ``near_oom`` event (once per episode)."""
    nvml_refresh_s: float | None = 10.0
    """On CUDA with ``rankmem[nvml]``, seconds between splits of device used by owner (NVML's process
    list, on a thread of its own: docs/device-attribution.md); None turns attribution off."""
    peak_source: str = field(default_factory=peak_source_default)
    """Where the per-window host peak comes from (docs/peak-source.md). ``window``: ``VmHWM`` reset at every
    window edge through ``/proc/self/clear_refs``, exact per window, but ``getrusage``, a parent's ``wait4``,
    ``/usr/bin/time -v`` and ``VmHWM`` pollers then see the last window's peak, not the process's.
    ``edges``: never reset; a window's peak is exact where it set a new lifetime high and otherwise the
    max RSS at its edges (a floor), flagged in the header, ``rankmem doctor`` and the report. Both keep
    ``mem/host/lifetime_peak_rss_gib`` true. Default ``window``, or ``$RANKMEM_PEAK_SOURCE``."""
    sink_thread: bool = True
    """Write sinks and run the leak watch on a background thread (the caller's thread only hands the
    collect over); False does it inside :meth:`Monitor.collect`."""

    def __post_init__(self) -> None:
        # Types first: options read from YAML or a command line arrive as strings, and a comparison of a
        # string would be a TypeError from inside rankmem rather than a line naming the option.
        if self.out_dir is not None and not isinstance(self.out_dir, (str, os.PathLike)):
            raise RankmemError(f"out_dir must be a directory path (a str), got {self.out_dir!r}")
        sinks = self.sinks
        if sinks is None:
            sinks = ("jsonl",) if self.out_dir is not None else ()
        elif isinstance(sinks, str):
            sinks = (sinks,)
        elif not isinstance(sinks, Iterable):
            raise RankmemError(f"sinks must be a list of sink names or objects, got {sinks!r}")
        object.__setattr__(self, "sinks", tuple(sinks))
        if not isinstance(self.sink_options, Mapping):
            raise RankmemError(f"sink_options must be a dict of sink name -> dict of options, got {self.sink_options!r}")
        check_sink_specs(self.sinks or (), self.out_dir, self.sink_options)
        object.__setattr__(self, "sink_options", {k: dict(v) for k, v in self.sink_options.items()})
        if not _whole(self.log_rank) or self.log_rank < 0:
            raise RankmemError(f"log_rank must be a rank: a whole number >= 0, got {self.log_rank!r}")
        if not _whole(self.oom_history) or self.oom_history < 0:
            raise RankmemError(f"oom_history must be a whole number of entries >= 0, got {self.oom_history!r}")
        # numpy's numbers as Python's: the config goes into the run log header as JSON.
        object.__setattr__(self, "log_rank", operator.index(self.log_rank))
        object.__setattr__(self, "oom_history", operator.index(self.oom_history))
        if self.peak_source not in PEAK_SOURCES:
            raise RankmemError(f"peak_source must be one of {list(PEAK_SOURCES)} (docs/peak-source.md), "
                               f"got {self.peak_source!r}")
        refresh = self.children_refresh_s
        if isinstance(refresh, bool) or not isinstance(refresh, numbers.Real) or not 0 < refresh < math.inf:
            raise RankmemError(f"children_refresh_s must be a finite number of seconds > 0, got {refresh!r}")
        object.__setattr__(self, "children_refresh_s", float(refresh))
        nvml = self.nvml_refresh_s
        if nvml is not None:
            if isinstance(nvml, bool) or not isinstance(nvml, numbers.Real) or not 0 < nvml < math.inf:
                raise RankmemError(f"nvml_refresh_s must be a finite number of seconds > 0, or None (off); got {nvml!r}")
            object.__setattr__(self, "nvml_refresh_s", float(nvml))

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> MonitorConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise RankmemError(f"unknown Monitor option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)

    def to_header(self) -> dict[str, Any]:
        # Field by field, not asdict(self): that deep-copies the sink objects (threads, locks, sockets).
        config = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)
                  if f.name not in ("sinks", "run_config")}
        config["sinks"] = [s if isinstance(s, str) else type(s).__name__ for s in self.sinks or ()]
        config["run"] = self.run_config
        return config


def make_attribution(config: MonitorConfig, device: DeviceBackend | None, nvml_module: Any,
                     where_now: Callable[[], Where]) -> DeviceAttribution | None:
    """NVML's split of device used, on CUDA: the real ``torch.cuda`` with pynvml, or a fake pair."""
    real = device is not None and getattr(device.module, "__name__", None) == "torch.cuda"
    if device is None or device.name != "cuda" or config.nvml_refresh_s is None:
        return None
    if nvml_module is None and not real:
        return None  # a fake torch.cuda without a fake NVML: the real driver knows nothing of it
    beats, rank = heartbeat_dir(config.out_dir), global_rank()

    def where() -> tuple[int | None, str | None]:
        try:  # read from the attribution thread while the training thread opens and closes phases
            w = where_now()
        except IndexError:  # the phase stack emptied between its test and its read
            return None, None
        return w.step, w.phase

    return DeviceAttribution(device, config.nvml_refresh_s, nvml_module=nvml_module, where=where,
                             siblings=lambda translated: node_siblings(beats, rank, translated))


def attribute(window: WindowBytes, phases: Mapping[str, PhaseBytes], attribution: DeviceAttribution) -> None:
    """The last device split into the window's figures (a few attribute reads: no NVML call here)."""
    split = attribution.poll()
    if split is not None:
        for name, part in ATTRIBUTION_FIELDS.items():
            setattr(window, name, getattr(split, part))
    for name, p in phases.items():
        p.device_descendants = attribution.phase_descendants.get(name)
def _check_launcher(group: Any) -> None:
    """Several ranks launched and no process group: every process would call itself rank 0 of 1, one run
    log would win and the report would say ``1 ranks``, exit 0. Refused here, where it can be fixed."""
    world = launcher_world() if group is None else None
    if world is not None:
        raise RankmemError(
            f"WORLD_SIZE={world} says this job has {world} ranks, but no process group is initialised: call "
            "torch.distributed.init_process_group() before building the Monitor (on every rank), or it would "
            "measure each process as a world of one (to measure this process alone, unset WORLD_SIZE)")


def _whole(value: Any) -> bool:
    """An integer, numpy's included; not a bool, a float or a string."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


class Monitor:
    """Per-rank memory telemetry. Build it on every rank; :meth:`collect` is a collective.

    ``group`` is the process group to aggregate over (default: the world, if initialised; none
    otherwise, in which case nothing is communicated). ``device_module`` replaces the torch device
    module of the backend (e.g. :class:`rankmem.testing.FakeCuda`); ``nvml_module`` replaces ``pynvml``
    (e.g. :class:`rankmem.testing.FakeNvml`); ``host_probe`` replaces the host probe (any
    :class:`rankmem.probe.host.HostProbe`). Keyword options are :class:`MonitorConfig` fields.
    """

    def __init__(self, config: MonitorConfig | None = None, *, group: Any = None, device_module: Any = None,
                 host_probe: HostProbe | None = None, nvml_module: Any = None, **options: Any) -> None:
        if config is not None and options:
            raise RankmemError("pass either a MonitorConfig or keyword options, not both")
        self.config = c = config if config is not None else MonitorConfig.from_options(options)
        _check_launcher(group)
        self.group = group
        self._guard = Guard()
        device = select_backend(c.device, device_module)
        host = host_probe if host_probe is not None else make_host_probe(
            c.children, c.children_refresh_s, reset_peaks=c.peak_source == "window")
        sinks = [make_sink(spec, c.out_dir, **(c.sink_options.get(spec, {}) if isinstance(spec, str) else {}))
                 for spec in c.sinks or ()]
        self._publisher = Publisher(sinks, c.leak_check, self._guard, background=c.sink_thread)
        self._attribution = make_attribution(c, device, nvml_module, lambda: self._windows.where)
        self._forensics = Forensics(c.out_dir, global_rank(), host, device, oom_history=c.oom_history,
                                    near_oom_watch=c.near_oom_watch, flush=lambda: self._publisher.flush(2.0),
                                    attribution=self._attribution)
        self._windows = Windows(host, device, self._guard, listener=self._forensics)
        self._exchange = Exchange(group, device.name if device else None, device.module if device else None,
                                  detail_rank=c.log_rank)
        self._last: tuple[int, float, Gathered, dict[str, float]] | None = None
        self._last_record: StepRecord | None = None
        self._detail = False
        self._closed = False
        self._pid = os.getpid()
        self._collecting = threading.Lock()

    @property
    def device_attribution(self) -> str:
        """What the split of device used by owner does here, or why it is off (``rankmem doctor``)."""
        if self._attribution is None:
            return "off (needs CUDA and nvml_refresh_s; a fake torch.cuda needs a fake NVML)"
        return self._attribution.status

    @property
    def rank(self) -> int:
        return rank_and_world(self.group)[0]

    @property
    def world_size(self) -> int:
        return rank_and_world(self.group)[1]

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == self.config.log_rank

    @property
    def device_backend(self) -> str:
        """``cuda``, ``npu``, ``xpu`` or ``none``: the backend chosen when the monitor was built."""
        return self._windows.device.name if self._windows.device else "none"

    @property
    def peak_rss_scope(self) -> str:
        """``window`` (reset per window), ``edges`` (never reset: ``peak_source="edges"``), ``lifetime``
        (the kernel cannot reset it) or ``sampled`` (off Linux)."""
        return str(self._windows.host.peak_scope)

    @property
    def fallbacks(self) -> int:
        """How many collects took the pickled path (the first, and any where ranks' keys differed)."""
        return self._exchange.packed.fallbacks

    @property
    def header(self) -> RunHeader | None:
        """The run header, known on every rank after the first :meth:`collect`."""
        return self._publisher.header

    @property
    def last_record(self) -> StepRecord | None:
        """The last collect's record, per-rank vectors included, on every rank (built on first use)."""
        if self._last_record is None and self._last is not None:
            step, when, gathered, metrics = self._last
            self._last_record = StepRecord(step, when, metrics, gathered.columns())
        return self._last_record

    def step(self, n: int | None = None) -> AbstractContextManager[None]:
        """A step window: peaks reset at entry, current values and peaks read at exit. Local; call
        :meth:`collect` after it on every rank, every step or every N steps. Unnumbered, its events say
        the step the next collect logs (unknown where collects are numbered with ``step=``)."""
        self._check_open()
        return self._windows.step(n)

    def set_step(self, n: int) -> None:
        """Name the step in progress for heartbeats, events and the next :meth:`collect` (unless given
        ``step=``), without a window: for framework hooks that bracket a step (``on_step_begin``). Local."""
        self._check_open()
        self._windows.set_step(n)

    def phase(self, name: str) -> AbstractContextManager[None]:
        """A named phase (``rollout``, ``log_prob``, ``update``, ...): its own peaks and the RSS /
        allocated deltas across it, under ``mem/phase/<name>/...``. Local to this rank."""
        self._check_open()
        return self._windows.phase(name)

    def local_metrics(self, metrics: Mapping[str, Any] | None = None) -> dict[str, float]:
        """This rank's per-rank keys for the window that just closed, plus the caller's scalars.
        Consumes the window: the next call starts a new one. :meth:`collect` calls this first."""
        self._check_open()
        window, phases = self._windows.take()
        if self._attribution is not None:
            attribute(window, phases, self._attribution)
        out: dict[str, float] = {}
        window_metrics(window, out)
        for name, p in phases.items():
            phase_metrics(name, p, out)
        out.update(scalar_items(metrics, self._guard.warn_once))
        return out

    def collect(self, metrics: Mapping[str, Any] | None = None, step: int | None = None) -> dict[str, float]:
        """Aggregate this window's per-rank figures and ``metrics`` across ranks in one collective.

        A collective: every rank of the group calls it, on the same steps. Returns, on every rank,
        ``K/max``, ``K/min``, ``K/mean``, ``K/max_rank`` and ``K/min_rank`` for every per-rank key
        ``K`` (memory and the caller's scalars), plus verl's ``perf/*`` keys. The logging rank writes.
        """
        self._check_call()
        if not self._collecting.acquire(blocking=False):
            raise RankmemError("collect() is already running in another thread: call it from one thread per rank "
                               "(two collectives at once on one process group corrupt it)")
        try:
            local = self._measure(metrics)
            step, stated = self._windows.next_step(step)
            if self._publisher.header is None:
                self._start()
            detail, self._detail = self._detail, False
            gathered = self._exchange.gather_aggregate(local, step if stated else None, detail=detail)
            out = {**gathered.aggregated, **verl_metrics(gathered.aggregated)} if self.config.verl_keys \
                else dict(gathered.aggregated)
            self._last, self._last_record = (int(step), time.time(), gathered, out), None
            if self._publisher.opened:
                self._publisher.publish(*self._last)
            return dict(out)  # the caller's own copy: the sinks write ``out`` later, on their thread
        finally:
            self._collecting.release()

    def _measure(self, metrics: Mapping[str, Any] | None) -> dict[str, float]:
        """This rank's keys; a telemetry bug must not leave the other ranks waiting: this rank then
        sends the caller's keys alone."""
        local = self._guard.call("local", "measuring this rank failed, it sends only the caller's metrics",
                                 self.local_metrics, metrics, default=None)
        if local is None:
            self._windows.discard()
            local = scalar_items(metrics, self._guard.warn_once)
        return local

    def _start(self) -> None:
        """The first collect: every rank learns who every rank is; the logging rank opens the sinks."""
        device = self._windows.device
        header = run_header(self.group, self.config.log_rank, self.config.to_header(),
                            device.device_name() if device else "none", self.peak_rss_scope,
                            device.device_uuid() if device else None)
        self._publisher.start(header, logging=self.rank == self.config.log_rank)

    def _check_call(self) -> None:
        """Misuse that would corrupt or hang the collective, raised before any communication."""
        self._check_open()
        if os.getpid() != self._pid and dist_active(self.group):
            raise RankmemError("collect() in a forked child: the child shares its parent's process group and would "
                               "corrupt it; measure in the child with rankmem.sample() instead")
        # Membership cannot change while the group lives: asked at the first collect only
        # (torch.distributed's lookups cost tens of microseconds right after a step's compute).
        if self._publisher.header is None and self.rank < 0:
            raise RankmemError("this rank is not a member of the Monitor's group: call collect() on the group's "
                               "ranks only, or build the Monitor with group=None")

    def _check_open(self) -> None:
        if self._closed:
            # Its descriptors are closed: every figure would read as unavailable, silently.
            raise RankmemError("this Monitor is closed: build a new one (on every rank) to go on measuring")

    def record_oom(self, exc: BaseException) -> None:
        """An out-of-memory error caught outside any window (a framework's exception hook) as an ``oom``
        event at the current step and phase. Local; never raises."""
        self._guard.call("forensics", "recording the OOM failed", self._forensics.record, exc, self._windows.where,
                         default=None)
        self._detail = True

    def request_detail(self) -> None:
        """Make the next collect carry every rank's values to the logging rank, whatever the cadence
        (past ``RANKMEM_REDUCE_ABOVE`` ranks the per-rank detail is logged every ``detail_every``
        collects only). Local: one rank asking is enough; smaller worlds log the detail every collect."""
        self._detail = True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the sinks have written every collect so far (they write on a background thread);
        False if ``timeout`` seconds passed first. Local."""
        return self._publisher.flush(timeout)

    def close(self) -> None:
        """Flush and close the sinks, close the probe's descriptors. Local; safe to call twice."""
        self._closed = True
        self._publisher.close()
        # Closed while an exception propagates (a finally block): the heartbeat says the exit was not clean.
        clean = sys.exc_info()[0] is None
        self._guard.call("forensics", "closing the event files failed", self._forensics.close, clean, default=None)
        if self._attribution is not None:
            self._attribution.close()
        self._windows.host.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
