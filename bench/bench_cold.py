"""What one window-edge read costs right after a training step's compute, against the same read repeated.

    python bench/bench_cold.py

A loop of reads (bench_probe.py, bench_heartbeat.py) finds the kernel's and the interpreter's paths
in the caches; a training thread meets them cold, once per step, after tens of milliseconds of
compute that evicted them. Each round runs ~30 ms of matrix products (one CPU thread), then times
one operation twice: ``cold`` is the first call, ``warm`` the one right after it. The operations rotate
from round to round; the median over rounds is reported, wall and this thread's CPU time.

The last three rows are the target's (the training thread's telemetry per step within 1.4x of the
cold reads its edges must make): two edges' reads done by hand (a ``status`` pread, its parse in one
regular-expression search and a ``clear_refs`` write, twice), an empty ``Monitor.step()`` window
(heartbeat on), and that window with the ``collect()`` that follows it (no process group, no sinks:
what the Monitor itself adds).
"""

from __future__ import annotations

import mmap
import os
import re
import statistics
import struct
import tempfile
import time
from collections.abc import Callable

ROUNDS = 100  # per operation: a median of 40 moved the window's ratio by +-0.07 from run to run
hwm_rss = re.compile(rb"\nVmHWM:\s*(\d+) kB\nVmRSS:\s*(\d+) kB").search


def main() -> None:
    import torch

    torch.set_num_threads(1)
    a = torch.randn(384, 384)

    def compute() -> None:
        for _ in range(40):  # ~30 ms here
            torch.mm(a, a)

    status = os.open("/proc/self/status", os.O_RDONLY)
    statm = os.open("/proc/self/statm", os.O_RDONLY)
    meminfo = os.open("/proc/meminfo", os.O_RDONLY)
    clear_refs = os.open("/proc/self/clear_refs", os.O_WRONLY)
    record = struct.Struct("<4sHHIiQqqd32sQ")
    tmp = tempfile.mkdtemp()
    beat = os.open(os.path.join(tmp, "hb"), os.O_RDWR | os.O_CREAT)
    os.ftruncate(beat, record.size)
    mapped = mmap.mmap(beat, record.size)

    import rankmem

    monitor = rankmem.Monitor(out_dir=tmp, sinks=(), device="cpu", near_oom_watch=False, leak_check=False)

    def floor_edges() -> None:  # the least Python a parse takes: one search, two int()
        for _ in range(2):
            found = hwm_rss(os.pread(status, 4096, 0))
            int(found[1]), int(found[2])  # type: ignore[index]
            os.write(clear_refs, b"5")

    def step() -> None:
        with monitor.step():
            pass

    def step_collect() -> None:
        with monitor.step():
            pass
        monitor.collect()

    words = memoryview(mapped)[:64].cast("q")
    floats = memoryview(mapped)[:64].cast("d")

    def item_stores() -> None:  # what a beat stores (Heartbeat.edge): seq, step, RSS, time, seq again
        words[2] = 1
        words[3] = 1
        words[4] = 1
        floats[5] = time.time()
        words[7] = 1

    def pack() -> bytes:
        return record.pack(b"RMHB", 1, 0, 1, 0, 1, 1, 1, time.time(), b"update", 1)

    ops: dict[str, Callable[[], object]] = {
        "pread /proc/self/status (RSS + peak)": lambda: os.pread(status, 4096, 0),
        "pread /proc/self/statm (RSS)": lambda: os.pread(statm, 256, 0),
        "pread /proc/meminfo (node)": lambda: os.pread(meminfo, 8192, 0),
        "write /proc/self/clear_refs (peak reset)": lambda: os.write(clear_refs, b"5"),
        "heartbeat: pwrite of the record": lambda: os.pwrite(beat, pack(), 0),
        "heartbeat: pack_into the mapped record": lambda: record.pack_into(mapped, 0, b"RMHB", 1, 0, 1, 0, 1, 1, 1,
                                                                           time.time(), b"update", 1),
        "heartbeat: five item stores into the map": item_stores,
        "os.getpid()": os.getpid,
        "empty call": lambda: None,
        "two edges' reads by hand (the floor)": floor_edges,
        "rankmem: empty step window": step,
        "rankmem: step window + collect()": step_collect,
    }
    names = list(ops)
    got: dict[str, list[tuple[float, float, float, float]]] = {n: [] for n in names}
    for i in range(ROUNDS * len(names)):
        name = names[i % len(names)]
        fn = ops[name]
        compute()
        times = []
        for _ in range(2):
            w, c = time.perf_counter(), time.thread_time()
            fn()
            times += [time.perf_counter() - w, time.thread_time() - c]
        got[name].append((times[0], times[1], times[2], times[3]))
    words.release()
    floats.release()
    mapped.close()
    monitor.close()
    for fd in (status, statm, meminfo, clear_refs, beat):
        os.close(fd)

    print(f"{ROUNDS} rounds per operation, median us: first call after ~30 ms of compute (cold) / the call right after")
    print(f"{'operation':44s} {'cold wall':>10s} {'cold CPU':>9s} {'warm wall':>10s} {'warm CPU':>9s}")
    for name in names:
        cols = [statistics.median(x[j] for x in got[name]) * 1e6 for j in range(4)]
        print(f"{name:44s} {cols[0]:10.1f} {cols[1]:9.1f} {cols[2]:10.1f} {cols[3]:9.1f}")
    floor = statistics.median(x[1] for x in got["two edges' reads by hand (the floor)"])
    print(f"load {os.getloadavg()[0]:.1f}; cold CPU, median (IQR) us, and the ratio of the medians to the "
          "floor's")
    for name in ("two edges' reads by hand (the floor)", "rankmem: empty step window",
                 "rankmem: step window + collect()"):
        q = statistics.quantiles([x[1] * 1e6 for x in got[name]], n=4)
        cold = statistics.median(x[1] for x in got[name])
        print(f"{name:44s} {cold * 1e6:7.1f} ({q[0]:.1f}-{q[2]:.1f}) {cold / floor:6.2f}x")
    print("targets: the empty step window 1.4x the floor")


if __name__ == "__main__":
    main()
