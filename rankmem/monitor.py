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

Each layer keeps its own state, and the facade only passes results along: a collect takes the
exchange's turn (misuse refused before any communication), measures this rank (windows), lets the
previous record settle (publish), marks the heartbeat's collect edges around the one collective
(forensics, exchange) and hands the result to the publisher, which keeps it and writes it.
"""

from __future__ import annotations

import copy
import math
import numbers
import operator
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import TYPE_CHECKING, Any

from rankmem.core.catalogue import rank_metrics
from rankmem.core.guard import Guard
from rankmem.core.records import RunHeader, StepRecord
from rankmem.core.rundir import current_run_id
from rankmem.core.scalars import plain_config, scalar_items, work_numbers
from rankmem.errors import RankmemError
from rankmem.exchange.dist import (
    detail_every_default,
    global_rank,
    rank_and_world,
    reduce_above_default,
    require_group_if_launched,
)
from rankmem.forensics.forensics import ATTRIBUTION_OFF, Forensics, device_attribution
from rankmem.probe.device import select_backend
from rankmem.probe.host import PEAK_SOURCES, HostProbe, LinuxHostProbe, make_host_probe, peak_source_default
from rankmem.publish.publisher import Publisher
from rankmem.sinks import Sink, check_sink_specs, make_sinks
from rankmem.windows import Windows

if TYPE_CHECKING:  # the anatomy (track()), the sampler (a device's) and NVML's split load where used
    from rankmem.anatomy import Tracker
    from rankmem.exchange.exchange import Exchange
    from rankmem.probe.nvmlwatch import DeviceAttribution


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """How a :class:`Monitor` measures and where it writes. Validated on construction."""

    device: str = "auto"
    """Device backend: ``auto`` (cuda, npu, xpu, in that order, if available), a backend name, or ``cpu``."""
    sinks: Sequence[str | Sink] | None = None
    """Sink names (``console``, ``jsonl``/``file``, ``tensorboard``, ``wandb``, ``mlflow``, ``prometheus``) or sink
    objects.
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
    """Seconds between re-listings of descendant processes; their RSS is read with the node figures."""
    node_refresh_s: float | None = 0.5
    """Seconds between reads of the node, cgroup and children figures on a thread of their own (a collect
    takes the last one; ``mem/node/age_s`` says how old); None reads them at every collect, on its
    thread. Linux's own probe only: a ``host_probe`` of the caller's (the Ray integration's too) and
    psutil's (off Linux, whose read feeds its sampled peak) are read at the collect."""
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
    anatomy_every: int = 0
    """On CUDA, every N-th step records the allocator's history, replayed off the training thread into an
    ``anatomy`` event: the top holders at its peak (docs/anatomy-replay.md). 0: on request only."""
    anatomy_share: float | None = None
    """Also sample the step after one whose peak allocated reached this share of capacity; None: never."""
    sink_thread: bool = True
    """Write sinks and run the leak watch on a background thread (the caller's thread only hands the
    collect over); False does it inside :meth:`Monitor.collect`."""
    reduce_above: int = field(default_factory=reduce_above_default)
    """Past this many ranks the aggregates travel by all-reduce and the per-rank detail only every
    ``detail_every`` collects (docs/how-it-works.md). Default 128, or ``$RANKMEM_REDUCE_ABOVE``. The
    same on every rank."""
    detail_every: int = field(default_factory=detail_every_default)
    """Past ``reduce_above`` ranks, collects between per-rank details. Default 100, or
    ``$RANKMEM_DETAIL_EVERY``. The same on every rank."""

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
        object.__setattr__(self, "run_config", plain_config(self.run_config))  # once: never the log's failure
        if not isinstance(self.sink_options, Mapping):
            raise RankmemError(f"sink_options must be a dict of sink name -> dict of options, "
                               f"got {self.sink_options!r}")
        check_sink_specs(self.sinks or (), self.out_dir, self.sink_options)
        object.__setattr__(self, "sink_options", {k: dict(v) for k, v in self.sink_options.items()})
        if not _whole(self.log_rank) or self.log_rank < 0:
            raise RankmemError(f"log_rank must be a rank: a whole number >= 0, got {self.log_rank!r}")
        share = self.anatomy_share
        if share is not None and not (isinstance(share, (int, float)) and 0 < share <= 1):
            raise RankmemError(f"anatomy_share must be a share of capacity in (0, 1] or None, got {share!r}")
        for name, least in (("anatomy_every", 0), ("oom_history", 0), ("reduce_above", 1), ("detail_every", 1)):
            if not _whole(getattr(self, name)) or getattr(self, name) < least:
                raise RankmemError(f"{name} must be a whole number >= {least}, got {getattr(self, name)!r}")
        # numpy's numbers as Python's: the config goes into the run log header as JSON.
        for name in ("log_rank", "oom_history", "reduce_above", "detail_every"):
            object.__setattr__(self, name, operator.index(getattr(self, name)))
        if self.peak_source not in PEAK_SOURCES:
            raise RankmemError(f"peak_source must be one of {list(PEAK_SOURCES)} (docs/peak-source.md), "
                               f"got {self.peak_source!r}")
        refresh = self.children_refresh_s
        if isinstance(refresh, bool) or not isinstance(refresh, numbers.Real) or not 0 < refresh < math.inf:
            raise RankmemError(f"children_refresh_s must be a finite number of seconds > 0, got {refresh!r}")
        object.__setattr__(self, "children_refresh_s", float(refresh))
        for name, off in (("nvml_refresh_s", "off"), ("node_refresh_s", "read at every collect")):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
                    raise RankmemError(f"{name} must be a finite number of seconds > 0, or None ({off}); "
                                       f"got {value!r}")
                object.__setattr__(self, name, float(value))

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


def _whole(value: Any) -> bool:
    """An integer, numpy's included (what ``operator.index`` takes); not a bool, a float or a string."""
    return not isinstance(value, bool) and hasattr(type(value), "__index__")


class _Readouts:
    """The read-only side of a :class:`Monitor`: who this rank is and what the layers know of the run.
    Each property asks the layer that knows and none communicates; kept apart so that the facade holds
    only what a training loop calls."""

    config: MonitorConfig
    group: Any
    _attribution: DeviceAttribution | None
    _windows: Windows
    _publisher: Publisher

    @cached_property
    def _exchange(self) -> Exchange:  # at the first collect: numpy's, loaded meanwhile by the priming thread
        from rankmem.exchange.exchange import Exchange

        device = self._windows.device
        return Exchange(self.group, device.name if device else None, device.module if device else None,
                        reduce_above=self.config.reduce_above, detail_every=self.config.detail_every,
                        detail_rank=self.config.log_rank)

    @property
    def device_attribution(self) -> str:
        """What the split of device used by owner does here, or why it is off (``rankmem doctor``)."""
        return ATTRIBUTION_OFF if self._attribution is None else self._attribution.status

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
        """The run header, known on every rank after the first :meth:`Monitor.collect`."""
        return self._exchange.header

    @property
    def tracker(self) -> Tracker | None:
        """What :meth:`Monitor.track` was told, or None; ``tracker.ptrs()`` gives the tracked storages'
        ``data_ptr()`` by category (params, grads, optimizer)."""
        anatomy = self._windows.anatomy
        return None if anatomy is None else anatomy.tracker

    @property
    def last_record(self) -> StepRecord | None:
        """The last collect's record, per-rank vectors included, on every rank (built on first use)."""
        return self._publisher.last_record


class Monitor(_Readouts):
    """Per-rank memory telemetry. Build it on every rank; :meth:`collect` is a collective.

    ``group`` is the process group to aggregate over (default: the world, if initialised; none otherwise,
    in which case nothing is communicated). ``device_module`` replaces the torch device module of the
    backend (e.g. :class:`rankmem.testing.FakeCuda`); ``nvml_module`` replaces ``pynvml`` (e.g.
    :class:`rankmem.testing.FakeNvml`); ``host_probe`` replaces the host probe (any
    :class:`rankmem.probe.host.HostProbe`). Keyword options are :class:`MonitorConfig` fields.
    """

    def __init__(self, config: MonitorConfig | None = None, *, group: Any = None, device_module: Any = None,
                 host_probe: HostProbe | None = None, nvml_module: Any = None, **options: Any) -> None:
        if config is not None and options:
            raise RankmemError("pass either a MonitorConfig or keyword options, not both")
        self.config = c = config if config is not None else MonitorConfig.from_options(options)
        require_group_if_launched(group)
        self.group = group
        self._guard = Guard()
        device = select_backend(c.device, device_module)
        host = host_probe if host_probe is not None else make_host_probe(
            c.children, c.children_refresh_s, reset_peaks=c.peak_source == "window")
        sinks = make_sinks(c.sinks or (), c.out_dir, c.sink_options)
        self._run_id = current_run_id()
        self._attribution = device_attribution(device, c.nvml_refresh_s, c.out_dir, nvml_module,
                                               lambda: self._windows.where)
        self._forensics = Forensics(c.out_dir, global_rank(), host, device, oom_history=c.oom_history,
                                    near_oom_watch=c.near_oom_watch, flush=lambda: self._publisher.flush(2.0),
                                    attribution=self._attribution, run_id=self._run_id, guard=self._guard)
        self._windows = Windows(host, device, self._guard, listener=self._forensics,
                                attribution=self._attribution,
                                node_refresh_s=c.node_refresh_s if isinstance(host, LinuxHostProbe) else None)
        if device is not None:  # sampled windows and OOM replays (forensics/sampler.py): a device's only
            from rankmem.forensics.sampler import HistorySampler
        self._sampler = None if device is None else HistorySampler(
            device, self._forensics.write_event, lambda: self._windows.where, every=c.anatomy_every,
            share=c.anatomy_share, history=c.oom_history)
        self._forensics.sampler = self._sampler
        # Last: its priming thread would share the GIL with the rest of this constructor.
        self._publisher = Publisher(sinks, c.leak_check, self._guard, background=c.sink_thread, verl_keys=c.verl_keys)
        self._closed = False
        self._gate = True  # until the first window: the priming thread's memory is in no user's window

    def step(self, n: int | None = None) -> AbstractContextManager[None]:
        """A step window: peaks reset at entry, current values and peaks read at exit. Local; call
        :meth:`collect` after it on every rank, every step or every N steps. Unnumbered, its events say
        the step the next collect logs (unknown where collects are numbered with ``step=``)."""
        if self._gate:  # _open_windows' check, inline: every step's entry is on the training thread
            self._pass_gate()
        window = self._windows.step(n)
        return window if self._sampler is None else self._sampler.step(window)

    def set_step(self, n: int) -> None:
        """Name the step in progress for heartbeats, events and the next :meth:`collect` (unless given
        ``step=``), without a window: for framework hooks that bracket a step (``on_step_begin``). Local."""
        self._open_windows().set_step(n)

    def phase(self, name: str) -> AbstractContextManager[None]:
        """A named phase (``rollout``, ``log_prob``, ``update``, ...): its own peaks and the RSS /
        allocated deltas across it, under ``mem/phase/<name>/...``. Local to this rank."""
        return self._open_windows().phase(name)

    def micro_batch(self, tokens: float, sequences: float | None = None, sq_tokens: float | None = None) -> None:
        """Tell the innermost open phase about one micro-batch: ``tokens`` it held (padding included if the
        model computes on it), its ``sequences`` and the sum of its squared sequence lengths ``sq_tokens``.
        Once per micro-batch, inside a phase (outside, ignored with one warning).

        The phase keeps its heaviest micro-batch's tokens and sequences, the largest ``sq_tokens`` and the
        totals under ``mem/phase/<name>/`` (``heaviest_mb_tokens``, ``heaviest_mb_sequences``,
        ``heaviest_mb_sq_tokens``, ``tokens``, ``micro_batches``): what ``rankmem advise`` fits against.
        """
        try:
            numbers = work_numbers(tokens, sequences, sq_tokens)
        except RankmemError as exc:  # a bad count must not stop training: its window is left out of the fit
            self._guard.warn_once("micro_batch_refused", f"{exc}: refused; the window it was told in is left "
                                  "out of the advice fit (its work keys are NaN)", stacklevel=3)
            numbers = (math.nan, None, None)
        if not self._open_windows().micro_batch(*numbers):
            self._guard.warn_once("micro_batch", "micro_batch() outside a phase is ignored: call it inside "
                                  "monitor.phase(...), where the phase's peak is measured", stacklevel=3)

    def track(self, model: Any, optimizer: Any = None) -> None:
        """Tell the monitor what this rank trains, so that every phase's peak is split into parameters,
        optimizer state, gradients (a range), activations, allocator slack and memory outside torch
        (``mem/phase/<name>/anatomy/*``, docs/anatomy.md). Once per model (actor, critic, reference), after
        it is on its device and wrapped (FSDP's ``fully_shard`` replaces the parameters), on every rank.
        Hooks ``optimizer``'s step and wraps its ``zero_grad`` (until close); each ``micro_batch()`` becomes an
        edge. Local."""
        windows = self._open_windows()
        if windows.anatomy is None:
            from rankmem.anatomy import Anatomy, Tracker
            device = windows.device
            kind = "cpu" if device is None else str(getattr(device.module, "tensor_device_type", device.name))
            windows.anatomy = Anatomy(Tracker(kind, self._guard, windows.boundary), device is not None)
        windows.anatomy.tracker.add(model, optimizer)
        if self._sampler is not None:  # its replay names parameter, gradient and optimizer blocks
            self._sampler.track(model, optimizer)

    def local_metrics(self, metrics: Mapping[str, Any] | None = None) -> dict[str, float]:
        """This rank's per-rank keys for the window that just closed, plus the caller's scalars.
        Consumes the window: the next call starts a new one. :meth:`collect` calls this first."""
        window, phases = self._open_windows().take()  # with the slow host figures and the device split
        return {**rank_metrics(window, phases), **scalar_items(metrics, self._guard.warn_once)}

    def collect(self, metrics: Mapping[str, Any] | None = None, step: int | None = None) -> dict[str, float]:
        """Aggregate this window's per-rank figures and ``metrics`` across ranks in one collective.

        A collective: every rank of the group calls it, on the same steps. Returns, on every rank, ``K/max``,
        ``K/min``, ``K/mean``, ``K/max_rank`` and ``K/min_rank`` for every per-rank key ``K`` (memory and the
        caller's scalars), plus verl's ``perf/*`` keys. The logging rank writes."""
        self._open_windows()
        with self._exchange.turn:  # misuse that would corrupt the group raises here, before any communication
            local = self._measure(metrics)
            if self._sampler is not None:
                self._sampler.after_collect(local)
            step, stated = self._windows.next_step(step)
            self._publisher.settle()  # the previous collect's record on disk before this one returns
            self._forensics.collect_edge()  # entered: a rank that never gets here is behind the ones waiting below
            if self._exchange.header is None:
                self._start()
            gathered = self._exchange.gather_aggregate(local, step if stated else None)
            self._forensics.collect_edge()
            return self._publisher.deliver(int(step), time.time(), gathered)

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
        """The first collect: every rank learns who every rank is and the run's id (the logging
        rank's, which forensics adopts); the logging rank opens the sinks."""
        header = self._exchange.start(self.config.log_rank, self.config.to_header(), self._windows.device,
                                      self.peak_rss_scope, self._run_id)
        self._forensics.adopt(header.run_id)
        self._publisher.start(header, logging=self.is_logging_rank)
        # The logging rank's first writes (files opened, the first leak judgement) allocate: the next
        # window waits for them, briefly (Handoff.SETTLE_S), so that they are in no user's phase.
        self._gate = self.is_logging_rank

    def _open_windows(self) -> Windows:
        if self._gate:
            self._pass_gate()
        return self._windows

    def _pass_gate(self) -> None:
        if self._closed:  # its descriptors are closed: every figure would read as unavailable, silently
            raise RankmemError("this Monitor is closed: build a new one (on every rank) to go on measuring")
        self._publisher.primed()
        self._publisher.settle()
        self._gate = False

    def record_oom(self, exc: BaseException) -> None:
        """An out-of-memory error caught outside any window (a framework's exception hook) as an ``oom``
        event at the current step and phase. Local; never raises."""
        self._forensics.record(exc, self._windows.where)
        self._exchange.request_detail()

    def request_anatomy(self) -> None:
        """Sample the next step's allocator history (on CUDA; ``anatomy_every``). Local."""
        if self._sampler is not None:
            self._sampler.request()

    def request_detail(self) -> None:
        """Make the next collect carry every rank's values to the logging rank, whatever the cadence
        (past ``reduce_above`` ranks the per-rank detail is logged every ``detail_every``
        collects only). Local: one rank asking is enough; smaller worlds log the detail every collect."""
        self._exchange.request_detail()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the sinks have written every collect so far (they write on a background thread);
        False if ``timeout`` seconds passed first. Local."""
        return self._publisher.flush(timeout)

    def close(self) -> None:
        """Flush and close the sinks, close the probe's descriptors. Local; safe to call twice."""
        self._closed = self._gate = True
        if self._windows.anatomy is not None:
            self._windows.anatomy.tracker.close()
        self._publisher.close()
        if self._sampler is not None:
            self._sampler.close()  # its last replay written before the event file closes
        # Closed while an exception propagates (a finally block): the heartbeat says the exit was not clean.
        self._forensics.close(clean=sys.exc_info()[0] is None)
        if self._attribution is not None:
            self._attribution.close()
        self._windows.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
