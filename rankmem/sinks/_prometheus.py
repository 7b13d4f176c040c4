"""The ``prometheus`` sink: a ``/metrics`` endpoint for the job, beside DCGM's, or Ray's metrics agent.

The training thread pays nothing: :meth:`PrometheusSink.write` runs on the publisher's thread and only
keeps a reference to the record; the endpoint's own threads (``prometheus_client``, on a threading
server whose connections time out after ``timeout_s``) build the exposition at each scrape. Names,
labels and the series bound: :mod:`rankmem.sinks._promfigures` and docs/prometheus.md.

Options (``sink_options={"prometheus": {...}}``, or ``rankmem train --sink-option prometheus.KEY=VALUE``):
``port`` (default :data:`DEFAULT_PORT`; 0 takes a free one, read back as :attr:`PrometheusSink.port`),
``bind`` (default loopback), ``top_k`` (per-rank series per key), ``job`` (default the run directory's
name), ``timeout_s``, and ``ray``: inside a Ray actor, publish through ``ray.util.metrics`` instead.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

from rankmem.core.records import RankInfo, RunHeader, StepRecord
from rankmem.errors import RankmemError
from rankmem.sinks._promevents import EventCounter
from rankmem.sinks._promfigures import Family, Figures

DEFAULT_PORT = 9465
DEFAULT_TOP_K = 3


def _whole(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RankmemError(f"the prometheus sink's {name} must be a whole number in {low}..{high}, got {value!r}")
    return value


class PrometheusSink:
    """Serves the last record's aggregates, worst ranks and top-k per-rank values on ``bind:port``."""

    def __init__(self, out_dir: str | None = None, port: int = DEFAULT_PORT, bind: str = "127.0.0.1",
                 top_k: int = DEFAULT_TOP_K, job: str | None = None, timeout_s: float = 10.0,
                 ray: bool = False) -> None:
        self.port = _whole("port", port, 0, 65535)
        self.top_k = _whole("top_k", top_k, 0, 1024)
        if not isinstance(bind, str) or not bind:
            raise RankmemError(f"the prometheus sink's bind must be an address (e.g. 127.0.0.1 or 0.0.0.0), got "
                               f"{bind!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
            raise RankmemError(f"the prometheus sink's timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        if not isinstance(ray, bool):
            raise RankmemError(f"the prometheus sink's ray must be true or false, got {ray!r}")
        self.bind, self.timeout_s, self.ray = bind, float(timeout_s), ray
        self.job = job or (os.path.basename(os.path.abspath(out_dir)) if out_dir else "rankmem")
        self._figures = Figures(self.job, self.top_k)
        self._events = EventCounter(out_dir)
        self._ranks: list[RankInfo] = []
        self._world = 0
        self._last: StepRecord | None = None
        self._detail: StepRecord | None = None
        self._httpd: Any = None
        self._thread: threading.Thread | None = None
        self._ray: Any = None

    def open(self, header: RunHeader) -> None:
        self._ranks, self._world = list(header.ranks), header.world_size
        if self.ray:
            from rankmem.sinks._raymetrics import RayMetrics, in_ray_actor

            if not in_ray_actor():
                raise RankmemError("the prometheus sink's ray=True needs the Monitor inside a Ray actor; "
                                   "outside one, leave ray off to serve the HTTP endpoint")
            self._ray = RayMetrics()
            return
        self._serve()

    def _serve(self) -> None:
        from wsgiref.simple_server import WSGIRequestHandler, make_server

        from prometheus_client import CollectorRegistry, make_wsgi_app
        from prometheus_client.exposition import ThreadingWSGIServer

        class Handler(WSGIRequestHandler):
            # A socket timeout ends a connection that sends or reads nothing (a stuck scraper).
            timeout = self.timeout_s

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
                pass  # one line per scrape on the job's stderr would drown its own output

        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in self.bind else socket.AF_INET

            def handle_error(self, request: Any, client_address: Any) -> None:
                # A scraper that timed out, reset or left is its own business: no traceback on the job's
                # stderr (socketserver prints one per connection). Anything else is a bug: shown once.
                if not isinstance(sys.exc_info()[1], OSError) and not self._shown:
                    self._shown = True
                    super().handle_error(request, client_address)

            _shown = False

        server = Server
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))  # type: ignore[arg-type]
        try:
            self._httpd = make_server(self.bind, self.port, make_wsgi_app(registry), server, handler_class=Handler)
        except OSError as exc:
            why = "is in use" if exc.errno in (98, 48) else f"cannot be bound ({exc.strerror})"
            raise RankmemError(f"port {self.port} on {self.bind} {why}, so this run serves no /metrics: pick another "
                               f"with sink_options={{'prometheus': {{'port': N}}}} (rankmem train: --sink-option "
                               f"prometheus.port=N), or 0 for any free port") from None
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="rankmem-prometheus", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.bind}]" if ":" in self.bind else self.bind
        return f"http://{host}:{self.port}/metrics"

    def write(self, record: StepRecord) -> None:
        # On the publisher's thread. The endpoint reads these two references; nothing is copied here.
        self._last = record
        if record.matrix is not None:
            self._detail = record
        elif record.ranks:  # a record built with per-rank lists (a caller's own): to the matrix once
            import numpy as np

            keys = tuple(record.ranks)
            cols = [[math.nan if v is None else v for v in record.ranks[k]] for k in keys]
            self._detail = StepRecord(record.step, record.time, record.metrics, keys=keys,
                                      matrix=np.array(cols, dtype=np.float64).T)
        if self._ray is not None:
            self._ray.publish(self.families())

    def families(self) -> list[Family]:
        """What a scrape shows now (from any thread)."""
        return self._figures.families(self._last, self._detail, self._ranks, self._world, self._events.counts())

    def close(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()


class _Collector:
    """``prometheus_client``'s view of the sink: its families, typed, at each scrape."""

    def __init__(self, sink: PrometheusSink) -> None:
        self._sink = sink

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for fam in self._sink.families():
            kind = CounterMetricFamily if fam.counter else GaugeMetricFamily
            out = kind(fam.name, fam.doc, labels=fam.labels)
            for values, value in fam.samples:
                out.add_metric(values, value)
            yield out
