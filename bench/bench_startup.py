"""Start-up: ``import rankmem``, ``rankmem --help``, a subcommand's help, ``Monitor()``.

    python bench/bench_startup.py            # --rounds N (default 21)

Each case runs in a fresh interpreter, the cases interleaved round by round with ``python -c pass`` (the
interpreter's own start, the baseline). Prints the median and IQR of the wall time and of the child's CPU
time (user + system, from ``getrusage``), and the ratio of the medians to the baseline's. ``Monitor()`` is
timed inside its process, after ``import rankmem``: the constructor's wall and this thread's CPU time
(default options with a run directory, so the run log, the leak watch and its priming are on), in a
process that imported torch first, as a training script has.
The children may write bytecode (``PYTHONDONTWRITEBYTECODE`` is dropped, and a first round, not counted,
writes it): a user's imports read cached bytecode, and compiling every module would time the compiler.
Targets: ``from rankmem import Monitor`` (``import rankmem`` loads each name at its first use) <= 60 ms,
``rankmem --help`` <= 150 ms, ``Monitor()`` <= 3 ms.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROUNDS = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 21

MONITOR = """
import json, tempfile, time
import torch  # a training script's, before rankmem's
from rankmem import Monitor
w, c = time.perf_counter(), time.thread_time()
m = Monitor(out_dir=tempfile.mkdtemp(), device="cpu")
w, c = time.perf_counter() - w, time.thread_time() - c
m.close()
print(json.dumps([w, c]))
"""

CASES = {
    "python -c pass (baseline)": ["-c", "pass"],
    "from rankmem import Monitor": ["-c", "from rankmem import Monitor"],
    "rankmem --help": ["-m", "rankmem", "--help"],
    "rankmem report --help": ["-m", "rankmem", "report", "--help"],
    "torch, rankmem, Monitor()": ["-c", MONITOR],
}


ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def run(args: list[str]) -> tuple[float, float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, check=True,
                         env=ENV).stdout
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, out


def spread(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4)
    return f"{statistics.median(xs) * 1e3:8.1f} ({(q[2] - q[0]) * 1e3:5.1f})"


def main() -> None:
    os.chdir(tempfile.mkdtemp())  # no runs/ of the caller's in the way
    wall: dict[str, list[float]] = {n: [] for n in CASES}
    cpu: dict[str, list[float]] = {n: [] for n in CASES}
    inside: list[tuple[float, float]] = []
    for args in CASES.values():
        run(args)  # bytecode written
    for _ in range(ROUNDS):
        for name, args in CASES.items():
            w, c, out = run(args)
            wall[name].append(w)
            cpu[name].append(c)
            if name.endswith("Monitor()"):
                inside.append(tuple(json.loads(out)))  # type: ignore[arg-type]
    base_w, base_c = (statistics.median(d["python -c pass (baseline)"]) for d in (wall, cpu))
    print(f"{ROUNDS} rounds, load {os.getloadavg()[0]:.2f}; ms: median (IQR)")
    print(f"{'case':28s} {'wall':>16s} {'CPU':>16s} {'wall/base':>9s} {'CPU/base':>9s}")
    for name in CASES:
        print(f"{name:28s} {spread(wall[name])} {spread(cpu[name])} "
              f"{statistics.median(wall[name]) / base_w:8.2f}x {statistics.median(cpu[name]) / base_c:8.2f}x")
    print(f"Monitor() itself, on the caller's thread: wall {spread([w for w, _ in inside])}, "
          f"thread CPU {spread([c for _, c in inside])}")


if __name__ == "__main__":
    main()
