"""The prometheus sink's cardinality and cost (issue 23), on simulated records and a real Monitor.

    python bench/bench_prometheus.py [--quick]

Prints, with the default options (top_k 3):
- series exposed against world size and keys, beside a naive exporter's one series per rank and key;
- the latency of a scrape of the endpoint (HTTP GET, parse not included) at 1,024 and 16,384 ranks,
  against a scrape of a registry holding one gauge (the HTTP stack's floor) measured in the same run;
- the training thread's cost: ``Monitor.collect()`` with the sink (and a scraper every 0.1 s) against
  the same collect with no sink; and ``PrometheusSink.write`` (on the publisher thread) per call.
"""

from __future__ import annotations

import argparse
import math
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable

import numpy as np

import rankmem
from rankmem.core.catalogue import CATALOGUE, PHASE_CATALOGUE, phase_key
from rankmem.core.records import RankInfo, RunHeader, StepRecord
from rankmem.sinks._prometheus import PrometheusSink


def keys_of(n: int) -> list[str]:
    keys = [s.key for s in CATALOGUE]
    for phase in ("rollout", "log_prob", "update", "ref", "gen", "eval"):
        keys += [phase_key(phase, s.key) for s in PHASE_CATALOGUE]
    return keys[:n]


def simulated(world: int, keys: list[str]) -> tuple[RunHeader, StepRecord]:
    matrix = np.random.default_rng(0).uniform(1.0, 2.0, size=(world, len(keys)))
    metrics: dict[str, float] = {}
    for j, key in enumerate(keys):
        col = matrix[:, j]
        metrics.update({f"{key}/max": col.max(), f"{key}/min": col.min(), f"{key}/mean": col.mean(),
                        f"{key}/max_rank": float(col.argmax()), f"{key}/min_rank": float(col.argmin())})
        if world > 128:  # the all-reduce path's quantiles across ranks
            metrics.update({f"{key}/p{q}": float(np.percentile(col, q)) for q in (50, 90, 99)})
    ranks = [RankInfo(rank=r, local_rank=r % 8, host=f"node{r // 8:05d}", pid=1000 + r, device="cuda:0 H200",
                      peak_rss_scope="window", device_uuid=f"GPU-{r:08x}-0000-0000-0000-000000000000")
             for r in range(world)]
    return RunHeader(world_size=world, ranks=ranks), StepRecord(5, time.time(), metrics, keys=keys, matrix=matrix)


def open_sink(world: int, keys: list[str]) -> tuple[PrometheusSink, StepRecord]:
    header, record = simulated(world, keys)
    sink = PrometheusSink(port=0)
    sink.open(header)
    sink.write(record)
    return sink, record


def scrape_ms(url: str, n: int, sink: PrometheusSink | None = None, record: StepRecord | None = None,
              ) -> tuple[float, float, int]:
    times, size = [], 0
    for step in range(n):
        if sink is not None and record is not None:  # a new collect before each scrape: nothing cached
            sink.write(StepRecord(step, time.time(), record.metrics, keys=record.keys, matrix=record.matrix.copy()))
        t = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as r:
            size = len(r.read())
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return statistics.median(times), times[int(0.95 * (len(times) - 1))], size


def series_table(worlds: list[int], key_counts: list[int]) -> None:
    print("| ranks | keys | series (rankmem) | series (one per rank and key) | exposition (KiB) |")
    print("|---|---|---|---|---|")
    for world in worlds:
        for nk in key_counts:
            header, record = simulated(world, keys_of(nk))
            sink = PrometheusSink(port=0)
            sink._ranks, sink._world = header.ranks, world  # families() without a server: the count only
            sink.write(record)
            fams = sink.families()
            series = sum(len(f.samples) for f in fams)
            size = sum(len(f.name) + 60 for f in fams for _ in f.samples)  # rough; scraped sizes below
            print(f"| {world:,} | {nk} | {series} | {world * nk:,} | ~{size / 1024:.0f} |")


def floor_url() -> tuple[str, Callable[[], None]]:
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    registry = CollectorRegistry()
    Gauge("floor", "one gauge", registry=registry).set(1.0)
    server, _ = start_http_server(0, "127.0.0.1", registry)
    return f"http://127.0.0.1:{server.server_address[1]}/metrics", server.shutdown


class NoopSink:
    """The baseline: the publisher thread runs and hands every record to a sink that keeps nothing."""

    def open(self, header: RunHeader) -> None:
        pass

    def write(self, record: StepRecord) -> None:
        pass

    def close(self) -> None:
        pass


def collect_us(make: Callable[[], list[object]], steps: int, scrape: bool = True) -> float:
    """Microseconds per ``Monitor.collect()``, a scraper hitting the sink's endpoint every 0.1 s if it has one."""
    sinks = make()
    monitor = rankmem.Monitor(sinks=sinks, device="cpu", children=False, leak_check=False)
    for s in range(20):  # warm: the first collect opens the sinks
        with monitor.step(s):
            pass
        monitor.collect({"loss": 1.0})
    monitor.flush(10)
    url = next((s.url for s in sinks if isinstance(s, PrometheusSink)), None) if scrape else None
    stop = threading.Event()

    def scrape_loop() -> None:
        while url is not None and not stop.wait(0.1):
            urllib.request.urlopen(url, timeout=10).read()

    thread = threading.Thread(target=scrape_loop, daemon=True)
    thread.start()
    spent = 0.0
    for s in range(steps):
        with monitor.step(100 + s):
            pass
        t = time.perf_counter()
        monitor.collect({"loss": 1.0})
        spent += time.perf_counter() - t
    stop.set()
    thread.join(5)
    monitor.close()
    return spent / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer scrapes and collects")
    args = parser.parse_args()
    scrapes, steps = (20, 500) if args.quick else (100, 3000)
    print("## series against world size and keys (top_k 3)")
    series_table([8, 64, 1024, 16384], [20, 40])
    print("\n## scrape latency (HTTP GET of /metrics, ms)")
    url, stop_floor = floor_url()
    floor_med, floor_p95, floor_size = scrape_ms(url, scrapes)
    print(f"one-gauge registry (floor): median {floor_med:.2f} p95 {floor_p95:.2f} ({floor_size} B)")
    for world in (1024, 16384):
        sink, record = open_sink(world, keys_of(20))
        med, p95, size = scrape_ms(sink.url, scrapes, sink, record)
        sink.close()
        print(f"{world:,} ranks, 20 keys: median {med:.2f} p95 {p95:.2f} ({size / 1024:.1f} KiB), "
              f"{med / floor_med:.1f}x the floor")
    stop_floor()
    print("\n## training thread: Monitor.collect() per call (1 process, us; best of 3 alternating rounds)")
    prom: Callable[[], list[object]] = lambda: [PrometheusSink(port=0)]  # noqa: E731
    configs: dict[str, tuple[Callable[[], list[object]], bool]] = {
        "no sink": (list, False), "a sink that keeps nothing": (lambda: [NoopSink()], False),
        "prometheus, not scraped": (prom, False), "prometheus, scraped every 0.1 s": (prom, True)}
    best = {name: math.inf for name in configs}
    for _ in range(3):
        for name, (make, scrape) in configs.items():
            best[name] = min(best[name], collect_us(make, steps, scrape))
    base = best["a sink that keeps nothing"]
    for name, us in best.items():
        print(f"{name}: {us:.1f} us ({us / base:.2f}x the sink that keeps nothing)")
    header, record = simulated(1024, keys_of(20))
    sink = PrometheusSink(port=0)
    sink._ranks, sink._world = header.ranks, 1024
    t = time.perf_counter()
    for _ in range(10000):
        sink.write(record)
    print(f"PrometheusSink.write (publisher thread), 1,024 ranks: {(time.perf_counter() - t) / 10000 * 1e6:.2f} us")


if __name__ == "__main__":
    main()
