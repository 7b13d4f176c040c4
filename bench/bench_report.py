"""``rankmem report`` on large run logs: the columnar side file against ``json.loads`` of per-rank lines.

Run:  python bench/bench_report.py [--steps 100000] [--ranks 8] [--repeat 2] [--wide-steps 10000]
      [--wide-ranks 1024] [--wide-detail-every 100]

Writes (once, cached under the temp dir) the same records through the real RunLogWriter twice: with the
per-rank values on the lines (``detail="inline"``: schema 1's layout, ~10 KiB a line at 8 ranks) and in
today's layout (aggregates on the lines, per-rank values in ``rankmem.ranks.arrow``). 28 per-rank keys
of a GPU run with two phases. Then times, in the same process, alternating: (a) ``for line in f:
json.loads(line)`` over the per-rank lines (the baseline: any reader of that layout pays at least this);
(b) ``read_run`` of the columnar log; (c) the whole report of the columnar log (read, per-key peaks with
phase attribution, per-phase table, growth, leak verdicts, rendering); (d) the same report of the inline
log. Prints each as a ratio to (a); the target is (a) / (c) >= 20.

Then a synthetic wide run as rankmem writes it past the all-reduce crossover: ``--wide-ranks`` ranks,
``--wide-steps`` steps, aggregates and p50/p90/p99 on every step, per-rank values every
``--wide-detail-every`` collects (the default cadence); the report of it is timed (target < 10 s) and
run once more in a fresh process for its peak RSS (the reader's memory).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stdout

import numpy as np

from rankmem.core.records import RankInfo, RunHeader, StepRecord
from rankmem.exchange.aggregate import aggregate
from rankmem.offline import read_run
from rankmem.offline.report import build_report, render
from rankmem.runlog import RunLogWriter

HOST = ("rss", "peak_rss", "lifetime_peak_rss", "children_rss")
NODE = ("used", "available")
DEVICE = ("allocated", "reserved", "peak_allocated", "peak_reserved", "lifetime_peak_reserved", "used", "total",
          "other", "headroom")
PHASE = ("peak_rss", "rss_delta", "peak_allocated", "peak_reserved", "allocated_delta")


def keys() -> list[str]:
    out = [f"mem/host/{k}_gib" for k in HOST] + [f"mem/node/{k}_gib" for k in NODE]
    out += [f"mem/device/{k}_gib" for k in DEVICE] + ["mem/device/alloc_retries", "mem/device/ooms"]
    out += [f"mem/phase/{p}/{k}_gib" for p in ("rollout", "update") for k in PHASE] + ["loss"]
    return sorted(out)


def generate(path: str, steps: int, world: int, detail: str, detail_every: int = 1) -> None:
    """``steps`` records of ``world`` ranks through the real writer; per-rank values every ``detail_every``
    collects (the others carry the aggregates and, past the crossover, p50/p90/p99: as the monitor does)."""
    from rankmem.exchange.reduce import QUANTILE_NAMES, matrix_quantiles

    rng = np.random.default_rng(0)
    ks = keys()
    ranks = [RankInfo(rank=r, local_rank=r % 8, host=f"node{r // 8}", pid=100 + r, device="cuda NVIDIA H100",
                      peak_rss_scope="window") for r in range(world)]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    writer = RunLogWriter(path, detail=detail)
    writer.open(RunHeader(world_size=world, ranks=ranks, config={}, started=1.7e9))
    level = rng.uniform(5, 60, (world, len(ks)))
    for step in range(steps):
        matrix = level + rng.normal(0, 0.01, level.shape)  # ranks x keys, full-precision floats
        metrics = aggregate(ks, matrix)
        if detail_every > 1:
            q = matrix_quantiles(matrix, None, 32)
            metrics.update({f"{k}/{n}": float(q[i, j]) for i, k in enumerate(ks) for j, n in enumerate(QUANTILE_NAMES)})
        carries = step % detail_every == 0
        writer.write(StepRecord(step=step, time=1.7e9 + step, metrics=metrics, keys=ks,
                                matrix=matrix if carries else None))
    writer.close()


def cached(name: str, steps: int, world: int, detail: str, detail_every: int = 1) -> str:
    """The run directory of a generated log, generated once per shape and kept in the temp dir."""
    run_dir = os.path.join(tempfile.gettempdir(), f"rankmem_bench2_{name}_{steps}x{world}_every{detail_every}")
    log = os.path.join(run_dir, "rankmem.jsonl")
    if not os.path.exists(os.path.join(run_dir, "done")):
        t0 = time.perf_counter()
        generate(log, steps, world, detail, detail_every)
        open(os.path.join(run_dir, "done"), "w").close()
        print(f"generated {run_dir} in {time.perf_counter() - t0:.1f} s")
    return run_dir


def sizes(run_dir: str) -> str:
    parts = [f"{e.name} {e.stat().st_size / 2**20:.0f} MiB" for e in sorted(os.scandir(run_dir), key=lambda e: e.name)
             if e.name.startswith("rankmem.")]
    return ", ".join(parts)


def report_of(run_dir: str) -> None:
    with redirect_stdout(io.StringIO()):
        render(build_report(read_run(run_dir)))


def peak_rss_mib(run_dir: str) -> float:
    """Peak RSS of a fresh process that imports rankmem and reports ``run_dir``, MiB."""
    # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across fork and exec, so a child would report this
    # process's own peak (the generator's).
    code = ("import io, contextlib, sys; from rankmem.cli import main; path = sys.argv[1];"
            "contextlib.redirect_stdout(io.StringIO()).__enter__(); rc = main(['report', path]);"
            "assert rc == 0, rc;"
            "sys.stderr.write(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])")
    out = subprocess.run([sys.executable, "-c", code, run_dir], capture_output=True, text=True, timeout=600)
    return int(out.stderr.strip().splitlines()[-1]) / 1024


def baseline_rss_mib() -> float:
    code = ("import sys; import numpy, pyarrow, rich; from rankmem.cli import main;"
            "import rankmem.offline.report, rankmem.offline.runlog;"
            "sys.stderr.write(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return int(out.stderr.strip().splitlines()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--wide-steps", type=int, default=10_000)
    parser.add_argument("--wide-ranks", type=int, default=1024)
    parser.add_argument("--wide-detail-every", type=int, default=100)
    args = parser.parse_args()
    if args.steps:
        compare(args)
    if args.wide_steps:
        wide(args)
    if os.path.exists("/proc/loadavg"):
        with open("/proc/loadavg") as f:
            print("load average after the runs (1, 5, 15 min):", " ".join(f.read().split()[:3]))


def compare(args: argparse.Namespace) -> None:
    """The columnar log against json.loads of the per-rank lines, and the report of both."""
    inline = cached("inline", args.steps, args.ranks, "inline")
    columnar = cached("columnar", args.steps, args.ranks, "columnar")
    inline_log = os.path.join(inline, "rankmem.jsonl")
    print(f"{args.steps} steps x {args.ranks} ranks, {len(keys())} per-rank keys")
    print(f"  per-rank lines: {sizes(inline)}")
    print(f"  columnar:       {sizes(columnar)}")

    def plain() -> None:
        with open(inline_log, encoding="utf-8") as f:
            for line in f:
                json.loads(line)

    # The machine is shared: alternate the contenders and keep each one's best of --repeat runs, in wall
    # time and in this process's CPU time (less disturbed by other processes on the same cores).
    contenders = (("plain", plain), ("read", lambda: read_run(columnar)), ("report", lambda: report_of(columnar)),
                  ("inline", lambda: report_of(inline)))
    wall = {name: math.inf for name, _ in contenders}
    cpu = dict(wall)
    for _ in range(args.repeat):
        for name, fn in contenders:
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name] = min(wall[name], time.perf_counter() - t0)
            cpu[name] = min(cpu[name], time.process_time() - c0)
    print(f"{'':44s}  {'wall':>17s}  {'cpu':>17s}")
    for name, label in (("plain", "(a) json.loads of each per-rank line:"), ("read", "(b) read_run, columnar:"),
                        ("report", "(c) rankmem report, columnar:"), ("inline", "(d) rankmem report, per-rank lines:")):
        print(f"{label:44s}  {wall[name]:6.2f} s ({wall['plain'] / wall[name]:5.1f}x)"
              f"  {cpu[name]:6.2f} s ({cpu['plain'] / cpu[name]:5.1f}x)")
    speedup = wall["plain"] / wall["report"]
    print(f"  target (a)/(c) >= 20x: {speedup:.1f}x wall, {cpu['plain'] / cpu['report']:.1f}x cpu: "
          f"{'PASS' if speedup >= 20 else 'FAIL'}")



def wide(args: argparse.Namespace) -> None:
    """A run past the all-reduce crossover, as rankmem writes it: its report's time and memory."""
    wide = cached("wide", args.wide_steps, args.wide_ranks, "columnar", args.wide_detail_every)
    print(f"\nwide: {args.wide_steps} steps x {args.wide_ranks} ranks, per-rank values every "
          f"{args.wide_detail_every} collects: {sizes(wide)}")
    best = math.inf
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        report_of(wide)
        best = min(best, time.perf_counter() - t0)
    base, peak = baseline_rss_mib(), peak_rss_mib(wide)
    print(f"  rankmem report: {best:.2f} s (target < 10 s: {'PASS' if best < 10 else 'FAIL'}); peak RSS "
          f"{peak:.0f} MiB in a fresh process, {peak - base:.0f} MiB over its imports ({base:.0f} MiB)")


if __name__ == "__main__":
    main()
