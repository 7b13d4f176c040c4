"""``rankmem report`` on large run logs against ``json.loads`` of their lines.

Run:  python bench/bench_report.py [--steps 100000] [--ranks 8] [--plain-steps 20000] [--plain-ranks 4]
      [--repeat 2]

1. ``--steps`` x ``--ranks`` with 28 per-rank keys of a GPU run with two phases, written through the real
   RunLogWriter (aggregates on the lines, per-rank values in ``rankmem.ranks.f64``). The baseline is
   ``json.loads`` of the same collects as per-rank JSON lines (what any reader of a per-rank text layout
   pays at least); then ``read_run`` and the whole report in this process. Target: baseline / report
   >= 30. The report's peak RSS in a fresh process is stated. Times are CPU seconds (see :func:`best`).
2. A plain loop's run (``--plain-steps`` x ``--plain-ranks``, the keys a CPU Monitor logs for a bare
   ``collect()``; then for a phased loop: README's ``forward`` and ``update`` phases in a step, with the
   ``track()`` its "What fills the peak" section adds): the whole ``rankmem report`` as a command, against
   ``json.loads`` over the run log's own lines. Target <= 0.5x.
   The command runs with its bytecode cached, as an installed package's is (one untimed run first; where
   PYTHONDONTWRITEBYTECODE is set, the cache goes to a temp dir): else every run compiles rankmem.

Logs are generated once and kept in the temp dir.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
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


def gpu_keys() -> list[str]:
    out = [f"mem/host/{k}_gib" for k in HOST] + [f"mem/node/{k}_gib" for k in NODE]
    out += [f"mem/device/{k}_gib" for k in DEVICE] + ["mem/device/alloc_retries", "mem/device/ooms"]
    out += [f"mem/phase/{p}/{k}_gib" for p in ("rollout", "update") for k in PHASE] + ["loss"]
    return sorted(out)


def cpu_keys(phased: bool = False) -> list[str]:
    """The per-rank keys a CPU Monitor logs for a loop with one metric (read off a real collect); with
    ``phased``, for README's loop (a step, its ``forward`` and ``update`` phases) with ``track()``."""
    import torch

    import rankmem

    monitor = rankmem.Monitor(device="cpu", children=False, leak_check=False, near_oom_watch=False)
    if phased:
        model = torch.nn.Linear(64, 64)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        monitor.track(model, optimizer)
        with monitor.step(0):
            with monitor.phase("forward"):
                loss = model(torch.randn(8, 64)).square().mean()
            with monitor.phase("update"):
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    got = monitor.collect({"loss": 1.0})
    monitor.close()
    return sorted(k[: -len("/max")] for k in got if k.endswith("/max"))


def generate(run_dir: str, steps: int, world: int, ks: list[str], per_rank_lines: str | None = None) -> None:
    """``steps`` collects of ``world`` ranks through the real writer; ``per_rank_lines``: also write the
    same collects as per-rank JSON lines there (the baseline's input)."""
    rng = np.random.default_rng(0)
    ranks = [RankInfo(rank=r, local_rank=r % 8, host=f"node{r // 8}", pid=100 + r, device="cuda NVIDIA H100",
                      peak_rss_scope="window") for r in range(world)]
    os.makedirs(run_dir, exist_ok=True)
    writer = RunLogWriter(os.path.join(run_dir, "rankmem.jsonl"))
    writer.open(RunHeader(world_size=world, ranks=ranks, config={}, started=1.7e9))
    lines = open(per_rank_lines, "w") if per_rank_lines else None  # noqa: SIM115 - closed below
    level = rng.uniform(5, 60, (world, len(ks)))
    for step in range(steps):
        matrix = level + rng.normal(0, 0.01, level.shape)  # ranks x keys, full-precision floats
        metrics = aggregate(ks, matrix)
        writer.write(StepRecord(step=step, time=1.7e9 + step, metrics=metrics, keys=ks, matrix=matrix))
        if lines is not None:
            ranks_obj = {k: matrix[:, j].tolist() for j, k in enumerate(ks)}
            lines.write(json.dumps({"kind": "step", "step": step, "time": 1.7e9 + step, "metrics": metrics,
                                    "ranks": ranks_obj}, separators=(",", ":")) + "\n")
    writer.close()
    if lines is not None:
        lines.close()


def cached(name: str, steps: int, world: int, ks: list[str], per_rank: bool) -> str:
    run_dir = os.path.join(tempfile.gettempdir(), f"rankmem_bench3_{name}_{steps}x{world}")
    if not os.path.exists(os.path.join(run_dir, "done")):
        t0 = time.perf_counter()
        generate(run_dir, steps, world, ks, os.path.join(run_dir, "per_rank.jsonl") if per_rank else None)
        open(os.path.join(run_dir, "done"), "w").close()
        print(f"generated {run_dir} in {time.perf_counter() - t0:.1f} s")
    return run_dir


def sizes(run_dir: str) -> str:
    return ", ".join(f"{e.name} {e.stat().st_size / 2**20:.0f} MiB" for e in sorted(os.scandir(run_dir),
                                                                                   key=lambda e: e.name)
                     if e.name.endswith((".jsonl", ".f64")))


def report_of(run_dir: str) -> None:
    with redirect_stdout(io.StringIO()):
        render(build_report(read_run(run_dir)))


def loads(path: str) -> None:
    with open(path, encoding="utf-8") as f:
        for line in f:
            json.loads(line)


CLI_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
if "PYTHONDONTWRITEBYTECODE" in os.environ:
    CLI_ENV["PYTHONPYCACHEPREFIX"] = os.path.join(tempfile.gettempdir(), "rankmem_bench_pycache")


def cli_report(run_dir: str) -> None:
    subprocess.run([sys.executable, "-m", "rankmem", "report", run_dir], check=True, capture_output=True, timeout=600,
                   env=CLI_ENV)


def peak_rss_mib(run_dir: str) -> float:
    """Peak RSS of a fresh process that runs ``rankmem report`` on ``run_dir``, MiB (VmHWM: ru_maxrss
    would carry this process's own peak across fork and exec)."""
    code = ("import io, contextlib, sys; from rankmem.cli import main; path = sys.argv[1];"
            "contextlib.redirect_stdout(io.StringIO()).__enter__(); rc = main(['report', path]);"
            "assert rc == 0, rc;"
            "sys.stderr.write(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])")
    out = subprocess.run([sys.executable, "-c", code, run_dir], capture_output=True, text=True, timeout=600,
                         env=CLI_ENV)
    return int(out.stderr.strip().splitlines()[-1]) / 1024


def best(contenders: dict[str, Callable[[], None]], repeat: int) -> dict[str, float]:
    """Each contender's best time of ``repeat``, alternating: CPU time of this process (and its
    children's, for a command), which a shared machine's load disturbs far less than wall time; the
    wall time is printed beside it."""
    cpu = {name: math.inf for name in contenders}
    for _ in range(repeat):
        for name, fn in contenders.items():
            t0, w0 = _cpu(), time.perf_counter()
            fn()
            cpu[name] = min(cpu[name], _cpu() - t0)
            print(f"    {name}: {cpu[name]:.2f} s cpu, {time.perf_counter() - w0:.2f} s wall")
    return cpu


def _cpu() -> float:
    """This process's and its waited-for children's CPU seconds (getrusage: os.times counts in 10 ms ticks)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--plain-steps", type=int, default=20_000)
    parser.add_argument("--plain-ranks", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    if args.steps:
        run = cached("gpu", args.steps, args.ranks, gpu_keys(), per_rank=True)
        print(f"{args.steps} steps x {args.ranks} ranks, {len(gpu_keys())} per-rank keys: {sizes(run)}")
        wall = best({"plain": lambda: loads(os.path.join(run, "per_rank.jsonl")), "read": lambda: read_run(run),
                     "report": lambda: report_of(run)}, args.repeat)
        for name, label in (("plain", "(a) json.loads of each per-rank line:"), ("read", "(b) read_run:"),
                            ("report", "(c) rankmem report (in process):")):
            print(f"  {label:40s} {wall[name]:6.2f} s ({wall['plain'] / wall[name]:5.1f}x)")
        speedup = wall["plain"] / wall["report"]
        print(f"  target (a)/(c) >= 30x: {speedup:.1f}x {'PASS' if speedup >= 30 else 'FAIL'}; "
              f"report peak RSS {peak_rss_mib(run):.0f} MiB (fresh process)")
    plain_runs = [("plain", cpu_keys()), ("phased", cpu_keys(phased=True))] if args.plain_steps else []
    for name, ks in plain_runs:
        run = cached(name, args.plain_steps, args.plain_ranks, ks, per_rank=False)
        print(f"\n{name} loop: {args.plain_steps} steps x {args.plain_ranks} ranks, {len(ks)} per-rank keys: "
              f"{sizes(run)}")
        cli_report(run)  # untimed: writes the bytecode cache where the environment keeps none
        wall = best({"loads": lambda run=run: loads(os.path.join(run, "rankmem.jsonl")),
                     "report": lambda run=run: report_of(run), "cli": lambda run=run: cli_report(run)}, args.repeat)
        print(f"  (a) json.loads of the run log's own lines: {wall['loads']:6.2f} s")
        print(f"  (b) rankmem report, in process:            {wall['report']:6.2f} s "
              f"({wall['report'] / wall['loads']:.2f}x)")
        print(f"  (c) rankmem report, the whole command:     {wall['cli']:6.2f} s ({wall['cli'] / wall['loads']:.2f}x)")
        print(f"  target (c)/(a) <= 0.5: {'PASS' if wall['cli'] <= 0.5 * wall['loads'] else 'FAIL'}; "
              f"report peak RSS {peak_rss_mib(run):.0f} MiB (fresh process)")
    if os.path.exists("/proc/loadavg"):
        with open("/proc/loadavg") as f:
            print("load average after the runs (1, 5, 15 min):", " ".join(f.read().split()[:3]))


if __name__ == "__main__":
    main()
