"""What a window edge (the ``clear_refs`` write, which takes the process's mmap write lock) costs while
another process reads this one's memory figures, as the near-OOM watch's per-rank table does.

    python bench/bench_edge_lock.py [seconds]

A "rank" child (torch imported: ~1,000 mappings; 1 GiB touched) writes ``5`` to ``/proc/self/clear_refs``
every millisecond for ``seconds`` and times each write; meanwhile this process reads, in a loop, nothing
(the baseline), ``/proc/CHILD/smaps_rollup`` (what the table read for every rank, issue 22), or
``/proc/CHILD/statm`` and ``status`` (what it reads now; smaps_rollup only for the one or two processes
that decide the largest private memory). Prints median, p99 and max of the write, and the ratios to the
baseline of the same run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading

CHILD = """
import json, os, sys, time
import numpy as np
import torch  # noqa: F401  (a rank's address space: its mappings are what smaps_rollup walks)
block = np.ones(1 << 30, dtype=np.uint8)
fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
print("ready", flush=True)
sys.stdin.readline()
out, end = [], time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    t = time.perf_counter_ns()
    os.write(fd, b"5")
    out.append((time.perf_counter_ns() - t) / 1e3)
    time.sleep(0.001)
print(json.dumps(out), flush=True)
"""


def reader(pid: int, files: tuple[str, ...], stop: threading.Event) -> None:
    while not stop.is_set():
        for name in files:
            try:
                with open(f"/proc/{pid}/{name}", "rb") as f:
                    f.read(8192)
            except OSError:
                return


def run(seconds: float, files: tuple[str, ...]) -> list[float]:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(seconds)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert child.stdin is not None and child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    stop = threading.Event()
    thread = threading.Thread(target=reader, args=(child.pid, files, stop), daemon=True)
    if files:
        thread.start()
    child.stdin.write("go\n")
    child.stdin.flush()
    times: list[float] = json.loads(child.stdout.readline())
    stop.set()
    child.wait(30)
    return times


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
    modes = {"no reader": (), "smaps_rollup (before)": ("smaps_rollup",), "statm+status (now)": ("statm", "status")}
    results = {name: run(seconds, files) for name, files in modes.items()}
    base = statistics.median(results["no reader"])
    print(f"{'reader in a loop':<24} {'writes':>7} {'median us':>10} {'p99 us':>9} {'max us':>9} {'median/base':>12}")
    for name, t in results.items():
        t.sort()
        p99 = t[int(len(t) * 0.99) - 1]
        print(f"{name:<24} {len(t):7d} {statistics.median(t):10.1f} {p99:9.1f} {t[-1]:9.1f} "
              f"{statistics.median(t) / base:12.1f}")


if __name__ == "__main__":
    main()
