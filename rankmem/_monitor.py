"""The Monitor: per-rank windows (steps, phases), one-collective aggregation, sinks on the logging rank.

Build one on every rank after ``init_process_group``::

    monitor = rankmem.Monitor(out_dir="runs/demo", sinks=("jsonl", "console"))
    for step in range(steps):
        with monitor.step(step):
            with monitor.phase("rollout"):
                ...
            with monitor.phase("update"):
                ...
        metrics = monitor.collect({"loss": loss})  # a collective: every rank calls it
    monitor.close()

Peaks are reset at every window edge (step or phase entry and exit); each open window keeps its own
running max of the pieces between edges, so a step's peak is the max over its phases and the gaps.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from rankmem import _collective
from rankmem._catalogue import PHASE_NAME, phase_metrics, verl_metrics, window_metrics
from rankmem._device import DeviceBackend, select_backend
from rankmem._host import HostProbe, make_host_probe
from rankmem._records import DeviceReading, PhaseBytes, RankInfo, RunHeader, StepRecord, WindowBytes
from rankmem.errors import RankmemError, WarnOnce
from rankmem.sinks import SINK_NAMES, SafeSink, Sink, make_sink


@dataclass
class MonitorConfig:
    """How a :class:`Monitor` measures and where it writes. Validated on construction."""

    device: str = "auto"
    """Device backend: ``auto`` (cuda, npu, xpu, in that order, if available), a backend name, or ``cpu``."""
    sinks: Sequence[str | Sink] | None = None
    """Sink names (``console``, ``jsonl``/``file``, ``tensorboard``, ``wandb``, ``mlflow``) or sink objects.
    Default: the run log (``jsonl``) when ``out_dir`` is set, nothing otherwise."""
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

    def __post_init__(self) -> None:
        if self.sinks is None:
            self.sinks = ("jsonl",) if self.out_dir is not None else ()
        elif isinstance(self.sinks, str):
            self.sinks = (self.sinks,)
        for s in self.sinks:
            if isinstance(s, str) and s not in SINK_NAMES:
                raise RankmemError(f"unknown sink {s!r}: choose from {', '.join(SINK_NAMES)}")
        needs_dir = any(s in ("jsonl", "file", "tensorboard") for s in self.sinks if isinstance(s, str))
        if needs_dir and self.out_dir is None:
            raise RankmemError("the jsonl/file/tensorboard sinks write to a directory: set out_dir='runs/NAME'")
        if self.log_rank < 0:
            raise RankmemError(f"log_rank must be >= 0, got {self.log_rank}")
        if not (self.children_refresh_s > 0):
            raise RankmemError(f"children_refresh_s must be > 0, got {self.children_refresh_s}")


class _Window:
    """An open window: its start values and its running max of the peaks seen between edges."""

    __slots__ = ("start_rss", "start_allocated", "start_retries", "start_ooms", "peak_rss", "peak_allocated", "peak_reserved")

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


def _max(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None or a >= b else b


def _delta(end: int | None, start: int | None) -> int | None:
    return None if end is None or start is None else end - start


class Monitor:
    """Per-rank memory telemetry. Build it on every rank; :meth:`collect` is a collective.

    ``group`` is the process group to aggregate over (default: the world, if initialised; none
    otherwise, in which case nothing is communicated). ``device_module`` replaces the torch device
    module of the backend, e.g. :class:`rankmem.testing.FakeCuda`. Keyword arguments are
    :class:`MonitorConfig` fields.
    """

    def __init__(
        self,
        config: MonitorConfig | None = None,
        *,
        group: Any = None,
        device_module: Any = None,
        **options: Any,
    ) -> None:
        if config is None:
            known = {f.name for f in fields(MonitorConfig)}
            unknown = sorted(set(options) - known)
            if unknown:
                raise RankmemError(f"unknown Monitor option(s) {unknown}; known: {sorted(known)}")
            config = MonitorConfig(**options)
        elif options:
            raise RankmemError("pass either a MonitorConfig or keyword options, not both")
        self.config = config
        self.group = group
        self._host: HostProbe = make_host_probe(config.children, config.children_refresh_s)
        self._device: DeviceBackend | None = select_backend(config.device, device_module)
        # The gather's device is resolved at the first collect, from the current device of this backend.
        dev = self._device
        self._gather = _collective.PackedGather(group, dev.name if dev else None, device_module=dev.module if dev else None)
        # Sinks are built (no I/O) on every rank, so a bad sink is the same error everywhere, here and
        # not later inside a collective; only the logging rank opens and writes them.
        self._sink_objects = [make_sink(spec, config.out_dir) for spec in config.sinks or ()]
        self._warn_once = WarnOnce()
        self._open: list[_Window] = []
        self._lifetime = _Window(None, None)
        self._step_window: WindowBytes | None = None
        self._phases: dict[str, PhaseBytes] = {}
        self._step_n: int | None = None
        self._collects = 0
        self._sinks: list[SafeSink] = []
        self._header: RunHeader | None = None
        self._last: tuple[int, float, dict[str, float], Sequence[str], np.ndarray] | None = None
        self._last_record: StepRecord | None = None
        self._is_logging_rank = False  # known at the first collect
        self._leak_watch: Any = None
        self._closed = False
        # Until the first step() the window is "everything since the last collect"; once step() is
        # used, collects need no window of their own and this one is dropped.
        self._implicit: _Window | None = self._begin()

    # ---- properties -------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return _collective.rank_and_world(self.group)[0]

    @property
    def world_size(self) -> int:
        return _collective.rank_and_world(self.group)[1]

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == self.config.log_rank

    @property
    def device_backend(self) -> str:
        """``cuda``, ``npu``, ``xpu`` or ``none``: the backend chosen when the monitor was built."""
        return self._device.name if self._device else "none"

    @property
    def peak_rss_scope(self) -> str:
        """``window`` (reset per window), ``lifetime`` (the kernel cannot reset it) or ``sampled``
        (off Linux: the max of the values read at window edges)."""
        return str(self._host.peak_scope)

    @property
    def header(self) -> RunHeader | None:
        """The run header, known on every rank after the first :meth:`collect`."""
        return self._header

    @property
    def last_record(self) -> StepRecord | None:
        """The last collect's record, per-rank vectors included, on every rank (built on first use:
        only the logging rank needs the per-rank lists every step)."""
        if self._last_record is None and self._last is not None:
            step, when, metrics, keys, matrix = self._last
            self._last_record = StepRecord(step=step, time=when, metrics=metrics, ranks=_columns(keys, matrix))
        return self._last_record

    def _check_leaks(self, step: int, keys: Sequence[str], matrix: np.ndarray) -> None:
        try:  # leak checking is advice: nothing in it may reach the training loop
            if self._leak_watch is None:
                from rankmem.leaks import LeakWatch

                self._leak_watch = LeakWatch()
            # The gathered matrix, not a StepRecord: the watch reads 3 columns, and building every
            # key's per-rank lists each collect would be wasted where no sink needs them.
            self._leak_watch.feed_matrix(step, keys, matrix)
        except Exception as exc:  # noqa: BLE001
            self.config.leak_check = False
            self._warn_once("leaks", f"online leak check failed and is off: {exc!r}")

    # ---- window edges -------------------------------------------------------------------------------
    def _edge(self) -> tuple[int | None, DeviceReading | None]:
        """Read the peaks since the last edge into every open window, then reset them. Returns the
        current RSS and device reading."""
        host, dev_backend = self._host, self._device
        host.check_fork()
        rss, peak_rss = host.rss_and_peak()
        dev = dev_backend.read() if dev_backend is not None else None
        peak_alloc = dev.peak_allocated if dev else None
        peak_res = dev.peak_reserved if dev else None
        # The edge itself is a point of every window: the current values bound the peaks from below.
        peak_rss = _max(peak_rss, rss)
        for w in self._open:
            w.fold(peak_rss, peak_alloc, peak_res)
        self._lifetime.fold(peak_rss, peak_alloc, peak_res)
        host.reset_peak()
        if dev_backend is not None:
            dev_backend.reset_peaks()
        return rss, dev

    def _begin(self) -> _Window:
        try:
            rss, dev = self._edge()
        except Exception as exc:  # noqa: BLE001 - telemetry never kills training
            self._warn_once("edge", f"memory probe failed, figures of this window are unavailable: {exc!r}")
            rss, dev = None, None
        window = _Window(rss, dev)
        window.fold(rss, dev.allocated if dev else None, dev.reserved if dev else None)
        self._open.append(window)
        return window

    def _end(self, window: _Window) -> tuple[int | None, DeviceReading | None]:
        try:
            rss, dev = self._edge()
        except Exception as exc:  # noqa: BLE001
            self._warn_once("edge", f"memory probe failed, figures of this window are unavailable: {exc!r}")
            rss, dev = None, None
        if window in self._open:
            self._open.remove(window)
        return rss, dev

    def _window_bytes(self, window: _Window, rss: int | None, dev: DeviceReading | None) -> WindowBytes:
        w = WindowBytes(rss=rss, peak_rss=window.peak_rss, lifetime_peak_rss=self._lifetime.peak_rss)
        if dev is not None:
            w.allocated, w.reserved = dev.allocated, dev.reserved
            w.peak_allocated, w.peak_reserved = window.peak_allocated, window.peak_reserved
            w.used, w.total = dev.used, dev.total
            w.alloc_retries = _delta(dev.alloc_retries, window.start_retries)
            w.ooms = _delta(dev.ooms, window.start_ooms)
            w.lifetime_peak_reserved = self._lifetime.peak_reserved
        return w

    def _add_host_now(self, w: WindowBytes) -> None:
        """Node, cgroup and children figures, read once per collect (not at every step end)."""
        host = self._host
        try:
            total, available = host.node()
            w.cgroup_used, w.cgroup_limit = host.cgroup()
            w.children_rss = host.children_rss()
        except Exception as exc:  # noqa: BLE001 - telemetry never kills training
            self._warn_once("host", f"host probe failed: {exc!r}")
            return
        w.node_available = available
        w.node_used = None if total is None or available is None else total - available

    @contextlib.contextmanager
    def step(self, n: int | None = None) -> Iterator[None]:
        """A step window: peaks reset at entry, current values and the window's peaks read at exit.

        Local to this rank (no collective); call :meth:`collect` after it on every rank, every step or
        every N steps (steps closed since the last collect merge: max peaks, summed events).
        """
        self._check_open()
        if self._implicit is not None:
            self._open.remove(self._implicit)
            self._implicit = None
        window = self._begin()
        try:
            yield
        finally:
            rss, dev = self._end(window)
            closed = self._window_bytes(window, rss, dev)
            # Steps not yet collected merge: collecting every N steps still sees every step's peak.
            self._step_window = closed if self._step_window is None else _merge(self._step_window, closed)
            if n is not None:
                self._step_n = int(n)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A named phase (``rollout``, ``log_prob``, ``update``, ...) inside a step, or between collects.

        Records the phase's own peaks and the RSS / allocated deltas across it under
        ``mem/phase/<name>/...``. A phase entered twice before a collect keeps the max peaks and the
        summed deltas. Local to this rank.
        """
        if not isinstance(name, str) or not PHASE_NAME.match(name):
            raise RankmemError(f"phase name must match [A-Za-z0-9_.-]+ (it becomes part of metric keys); got {name!r}")
        self._check_open()
        window = self._begin()
        try:
            yield
        finally:
            rss, dev = self._end(window)
            p = self._phases.setdefault(name, PhaseBytes())
            p.peak_rss = _max(p.peak_rss, window.peak_rss)
            p.rss_delta = _sum(p.rss_delta, _delta(rss, window.start_rss))
            if dev is not None:
                p.peak_allocated = _max(p.peak_allocated, window.peak_allocated)
                p.peak_reserved = _max(p.peak_reserved, window.peak_reserved)
                p.allocated_delta = _sum(p.allocated_delta, _delta(dev.allocated, window.start_allocated))

    # ---- collect ------------------------------------------------------------------------------------
    def local_metrics(self, metrics: Mapping[str, Any] | None = None) -> dict[str, float]:
        """This rank's per-rank keys for the window that just closed, plus the caller's scalars.

        Consumes the window: the next call starts a new one. :meth:`collect` calls this first.
        """
        self._check_open()
        if self._step_window is None:
            # No step closed since the last collect: the window is everything since then (or, once
            # step() is in use, just this instant).
            window = self._implicit if self._implicit is not None else self._begin()
            rss, dev = self._end(window)
            self._step_window = self._window_bytes(window, rss, dev)
            if self._implicit is not None:
                self._implicit = self._begin()
        self._add_host_now(self._step_window)
        out: dict[str, float] = {}
        window_metrics(self._step_window, out)
        for name, p in self._phases.items():
            phase_metrics(name, p, out)
        if metrics:
            for key, value in metrics.items():
                number = _to_float(value)
                if number is None:
                    self._warn_once(f"metric:{key}", f"metric {key!r} is not a scalar ({type(value).__name__}); left out")
                    continue
                out[str(key)] = number
        self._step_window = None
        self._phases = {}
        return out

    def collect(self, metrics: Mapping[str, Any] | None = None, step: int | None = None) -> dict[str, float]:
        """Aggregate this window's per-rank figures and ``metrics`` across ranks in one collective.

        A collective: every rank of the group calls it, on the same steps. Returns, on every rank,
        ``K/max``, ``K/min``, ``K/mean`` and ``K/max_rank`` for every per-rank key ``K`` (memory and
        the caller's scalars), plus verl's ``perf/*`` memory keys. The logging rank also writes sinks.
        """
        try:
            local = self.local_metrics(metrics)
        except RankmemError:
            raise  # a user error (a closed monitor) that every rank meets alike
        except Exception as exc:  # noqa: BLE001 - a telemetry bug must not leave the other ranks waiting
            self._warn_once("local", f"measuring this rank failed, it sends only the caller's metrics: {exc!r}")
            self._step_window, self._phases = None, {}
            local = {str(k): f for k, v in (metrics or {}).items() if (f := _to_float(v)) is not None}
        if step is None:
            step = self._step_n if self._step_n is not None else self._collects
        self._step_n = None
        self._collects += 1
        if self._header is None:
            rank, world = _collective.rank_and_world(self.group)
            if self.config.log_rank >= world:  # every rank knows the world size: all raise together
                raise RankmemError(f"log_rank={self.config.log_rank} but the group has {world} rank(s): use 0..{world - 1}")
            self._header = self._make_header()
            self._is_logging_rank = rank == self.config.log_rank
            if self._is_logging_rank:
                self._open_sinks(self._header)
        keys = tuple(sorted(local))
        schemas, rows = self._gather.gather(keys, [local[k] for k in keys])
        mixed = not all(s == keys for s in schemas)  # ranks sent different keys
        if not mixed:
            agg_keys: Sequence[str] = keys
            matrix = np.vstack(rows) if rows else np.zeros((0, 0))
        else:
            agg_keys, matrix = _collective.union_matrix(schemas, rows)
            differing = sorted(set(agg_keys) - set.intersection(*(set(s) for s in schemas)))
            self._warn_once(
                "keys:" + ",".join(differing),
                f"ranks reported different keys {differing}; each is aggregated over the ranks that have it",
            )
        aggregated = _collective.aggregate(agg_keys, matrix, nan_is_absent=mixed)
        if self.config.verl_keys:
            aggregated.update(verl_metrics(aggregated))
        self._last = (int(step), time.time(), aggregated, agg_keys, matrix)
        self._last_record = None
        if self._is_logging_rank and self.config.leak_check:
            self._check_leaks(int(step), agg_keys, matrix)
        if self._is_logging_rank and self._sinks:
            record = self.last_record
            assert record is not None
            for sink in self._sinks:
                sink.write(record)
        return aggregated

    def _make_header(self) -> RunHeader:
        rank, world = _collective.rank_and_world(self.group)
        me = RankInfo(
            rank=rank,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            host=socket.gethostname(),
            pid=os.getpid(),
            device=self._device.device_name() if self._device else "none",
            peak_rss_scope=self._host.peak_scope,
        )
        infos = _collective.all_gather_objects(asdict(me), self.group)  # once per run
        config = {k: v for k, v in asdict(self.config).items() if k not in ("sinks", "run_config")}
        config["sinks"] = [s if isinstance(s, str) else type(s).__name__ for s in self.config.sinks or ()]
        config["run"] = self.config.run_config
        return RunHeader(world_size=world, ranks=[RankInfo(**i) for i in infos], config=config, started=time.time())

    def _open_sinks(self, header: RunHeader) -> None:
        for sink_object in self._sink_objects:
            sink = SafeSink(sink_object)
            sink.open(header)
            self._sinks.append(sink)

    def _check_open(self) -> None:
        if self._closed:
            # Its descriptors are closed: every figure would read as unavailable, silently.
            raise RankmemError("this Monitor is closed: build a new one (on every rank) to go on measuring")

    def close(self) -> None:
        """Close the sinks and the probe's descriptors. Local; safe to call twice."""
        self._closed = True
        for sink in self._sinks:
            sink.close()
        self._sinks = []
        close = getattr(self._host, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _merge(earlier: WindowBytes, later: WindowBytes) -> WindowBytes:
    """Two consecutive windows as one: the max of the peaks, the sum of the event counts, and the
    later window's current values."""
    later.peak_rss = _max(earlier.peak_rss, later.peak_rss)
    later.peak_allocated = _max(earlier.peak_allocated, later.peak_allocated)
    later.peak_reserved = _max(earlier.peak_reserved, later.peak_reserved)
    later.alloc_retries = _sum(earlier.alloc_retries, later.alloc_retries)
    later.ooms = _sum(earlier.ooms, later.ooms)
    return later


def _sum(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else a + b


def _to_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    item = getattr(value, "item", None)  # a 0-d tensor or numpy scalar; .item() on a GPU tensor syncs
    if item is not None:
        try:
            return float(item())
        except (TypeError, ValueError, RuntimeError):
            return None
    return None


def _columns(keys: Sequence[str], matrix: np.ndarray) -> dict[str, list[float | None]]:
    cols = matrix.T.tolist()
    return {k: [None if math.isnan(v) else v for v in col] for k, col in zip(keys, cols, strict=True)}
