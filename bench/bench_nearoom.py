"""CPU cost of the near-OOM watch at its default interval, against an idle baseline in the same run.

    python bench/bench_nearoom.py [seconds]

Runs the watch thread (default config: a poll every 0.2 s) for ~10 s and reports the CPU time that
thread used as a share of one core (``time.thread_time`` inside the thread), next to a thread that
only sleeps on the same schedule (the wake-ups alone). Also prints the cost of one poll. Target: the
watch under 0.5% of one core.

Where this process's cgroup has no memory limit the poll skips the cgroup reads (usage, memory.stat);
to measure that path run it inside a limited cgroup, e.g. ``systemd-run --scope -p MemoryMax=8G python
bench/bench_nearoom.py``.
"""

from __future__ import annotations

import sys
import threading
import time

from rankmem.forensics.nearoom import NearOomConfig, NearOomWatch


def idle_thread_cpu(seconds: float, interval_s: float) -> float:
    """CPU seconds of a thread that wakes on the watch's schedule and does nothing."""
    stop = threading.Event()
    used = [0.0]

    def run() -> None:
        while not stop.wait(interval_s):
            pass
        used[0] = time.thread_time()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(seconds)
    stop.set()
    thread.join()
    return used[0]


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    config = NearOomConfig()  # never fires on a healthy machine: this is the steady-state cost
    watch = NearOomWatch(lambda info: None, config, rank=0)
    polls = 2000
    start = time.perf_counter()
    for _ in range(polls):
        watch.check()
    poll_us = (time.perf_counter() - start) / polls * 1e6

    watch.start()
    time.sleep(seconds)
    watch.stop()
    watch_pct = watch.cpu_s / seconds * 100
    idle_pct = idle_thread_cpu(seconds, config.interval_s) / seconds * 100
    cg = watch.cgroup
    print(f"cgroup: {f'v{cg.version} {cg.dir}' if cg else 'none'}; pressure: {watch.pressure_scope}")
    print(f"one poll (check):            {poll_us:8.1f} us")
    print(f"watch thread, {seconds:g} s at {config.interval_s:g} s:  {watch_pct:7.3f} % of one core")
    print(f"idle thread, same schedule:  {idle_pct:7.3f} % of one core")
    print(f"watch over idle:             {watch_pct - idle_pct:7.3f} % of one core (target < 0.5 %)")


if __name__ == "__main__":
    main()
