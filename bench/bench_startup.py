"""Start-up: ``import rankmem``, ``rankmem --help``, a subcommand's help, ``Monitor()``.

    python bench/bench_startup.py            # --rounds N (default 21); --trees A B: each case under
                                             # PYTHONPATH=A, then B (before/after), interleaved

Each case runs in a fresh interpreter, the cases interleaved round by round with ``python -c pass`` (the
interpreter's own start, the baseline). Prints the median and IQR of the wall time and of the child's CPU
time (user + system, from ``getrusage``), and the ratio of the medians to the baseline's. ``Monitor()`` is
timed inside its process, after ``import rankmem``: the constructor's wall and this thread's CPU time
(default options with a run directory, so the run log, the leak watch and its priming are on), in a
process that imported torch first, as a training script has.
The import's own CPU time is also timed inside the process (``time.process_time`` around the statement),
in a fresh interpreter and after ``import torch`` as in a training job. There the target is read: a job
has imported torch (and with it most of what rankmem's modules import from the standard library), and
torch's own garbage is collected before the clock starts (``gc.collect()``): torch leaves a full
collection pending (~75 ms here) that lands on whatever allocates next, rankmem or not.
The children may write bytecode (``PYTHONDONTWRITEBYTECODE`` is dropped, and a first round, not counted,
writes it): a user's imports read cached bytecode, and compiling every module would time the compiler.
Targets: ``from rankmem import Monitor`` (``import rankmem`` loads each name at its first use) <= 60 ms
(its own CPU time after torch), ``rankmem --help`` <= 150 ms, ``Monitor()`` <= 3 ms.
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
import gc, json, tempfile, time
import torch  # a training script's, before rankmem's
gc.collect()
i = time.process_time()
from rankmem import Monitor
i = time.process_time() - i
w, c = time.perf_counter(), time.thread_time()
m = Monitor(out_dir=tempfile.mkdtemp(), device="cpu")
w, c = time.perf_counter() - w, time.thread_time() - c
m.close()
print(json.dumps([w, c, i]))
"""

CASES = {
    "python -c pass (baseline)": ["-c", "pass"],
    "from rankmem import Monitor": ["-c", "import time; i = time.process_time(); from rankmem import Monitor; "
                                    "print(time.process_time() - i)"],
    "rankmem --help": ["-m", "rankmem", "--help"],
    "rankmem report --help": ["-m", "rankmem", "report", "--help"],
    "torch, rankmem, Monitor()": ["-c", MONITOR],
}


ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
TREES = sys.argv[sys.argv.index("--trees") + 1:] if "--trees" in sys.argv else [""]


def run(args: list[str], tree: str = "") -> tuple[float, float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, check=True,
                         env={**ENV, "PYTHONPATH": os.path.abspath(tree)} if tree else ENV).stdout
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, out


def spread(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4)
    return f"{statistics.median(xs) * 1e3:8.1f} ({(q[2] - q[0]) * 1e3:5.1f})"


def main() -> None:
    os.chdir(tempfile.mkdtemp())  # no runs/ of the caller's in the way
    runs = [(tree, name) for tree in TREES for name in CASES]
    wall: dict[tuple[str, str], list[float]] = {r: [] for r in runs}
    cpu: dict[tuple[str, str], list[float]] = {r: [] for r in runs}
    inside: dict[str, list[list[float]]] = {tree: [] for tree in TREES}
    fresh: dict[str, list[float]] = {tree: [] for tree in TREES}
    for tree, name in runs:
        run(CASES[name], tree)  # bytecode written
    for _ in range(ROUNDS):
        for tree, name in runs:
            w, c, out = run(CASES[name], tree)
            wall[tree, name].append(w)
            cpu[tree, name].append(c)
            if name.endswith("Monitor()"):
                inside[tree].append(json.loads(out))
            elif name.startswith("from"):
                fresh[tree].append(float(out))
    print(f"{ROUNDS} rounds, load {os.getloadavg()[0]:.2f}; ms: median (IQR)")
    for tree in TREES:
        base_w, base_c = (statistics.median(d[tree, "python -c pass (baseline)"]) for d in (wall, cpu))
        print(f"\n{tree or 'this tree'}\n{'case':28s} {'wall':>16s} {'CPU':>16s} {'wall/base':>9s} {'CPU/base':>9s}")
        for name in CASES:
            w, c = wall[tree, name], cpu[tree, name]
            print(f"{name:28s} {spread(w)} {spread(c)} {statistics.median(w) / base_w:8.2f}x "
                  f"{statistics.median(c) / base_c:8.2f}x")
        got = inside[tree]
        print(f"from rankmem import Monitor, its own CPU: fresh interpreter {spread(fresh[tree])}, after torch "
              f"{spread([i for _, _, i in got])}")
        print(f"Monitor() itself, on the caller's thread: wall {spread([w for w, _, _ in got])}, "
              f"thread CPU {spread([c for _, c, _ in got])}")


if __name__ == "__main__":
    main()
