"""Heartbeat cost per window edge, against baselines measured in the same run.

    python bench/bench_heartbeat.py

Prints microseconds per call for one ``Heartbeat.beat`` (the fixed record packed into the file's
memory map), an empty Python call, and a bare ``os.pwrite`` of the same bytes with no packing (what a
beat cost before the map); and the ratios. In a loop all are warm: ``bench_cold.py`` times the same
writes right after a step's compute, where the map's missing system call matters.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable

from rankmem.forensics.heartbeat import RECORD_SIZE, Heartbeat

REPEAT = 50000
ROUNDS = 5


def per_call_us(fn: Callable[[], object], n: int = REPEAT) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        beat = Heartbeat(tmp, 0)
        fd = os.open(os.path.join(tmp, "raw"), os.O_WRONLY | os.O_CREAT)
        record = bytes(RECORD_SIZE)
        step = [0]

        def one_beat() -> None:
            step[0] += 1
            beat.beat(step[0], "update", 3 << 30)

        def empty() -> None:
            pass

        def raw_pwrite() -> None:
            os.pwrite(fd, record, 0)

        cases: dict[str, Callable[[], object]] = {
            "Heartbeat.beat(step, phase, rss)": one_beat,
            "empty function call": empty,
            f"os.pwrite of {RECORD_SIZE} bytes (no packing)": raw_pwrite,
        }
        best = {name: float("inf") for name in cases}
        for _ in range(ROUNDS):  # interleaved rounds; the best of each is the least disturbed
            for name, fn in cases.items():
                best[name] = min(best[name], per_call_us(fn))
        beat.close()
        os.close(fd)
    raw = best[f"os.pwrite of {RECORD_SIZE} bytes (no packing)"]
    print(f"{'case':44s} {'us/call':>9s} {'vs pwrite':>10s}")
    for name, us in best.items():
        print(f"{name:44s} {us:9.3f} {us / raw:9.2f}x")
    print(f"beat minus a bare pwrite: {best['Heartbeat.beat(step, phase, rss)'] - raw:+.3f} us per edge")


if __name__ == "__main__":
    main()
