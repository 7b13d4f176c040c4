"""rankmem's own host memory per rank: RSS of two ranks doing identical work, without rankmem, with a
Monitor and no sinks, and with the run log on (logging rank 0), in the same run.

    python bench/bench_own_memory.py [repeats]

Each mode launches tests/dist_scripts/symmetric_rss_worker.py on 2 gloo ranks under torchrun (30 steps);
each rank reads its RSS from /proc/self/statm after the last collect. Prints each rank's RSS, what
rankmem adds over the baseline, and rank 0 - rank 1 (the bias a worst-rank verdict would carry), as the
median over ``repeats`` launches. Target: rank 0 - rank 1 <= 4 MiB with the run log on (it is written
by the logging rank's own thread; no other process).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _torchrun import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests/dist_scripts/symmetric_rss_worker.py"
MIB = 1 << 20


def launch(mode: str) -> tuple[int, int]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(WORKER), out, mode]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-2000:])
        r0, r1 = (int((Path(out) / f"rank{r}.rss").read_text().split()[0]) for r in range(2))
        return r0, r1


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    results: dict[str, tuple[float, float]] = {}
    for mode in ("none", "monitor", "runlog"):
        runs = [launch(mode) for _ in range(repeats)]
        results[mode] = (statistics.median(r[0] for r in runs) / MIB, statistics.median(r[1] for r in runs) / MIB)
    base0, base1 = results["none"]
    print(f"{'mode':<10} {'rank 0 MiB':>11} {'rank 1 MiB':>11} {'+rank 0':>8} {'+rank 1':>8} {'0 - 1':>7}")
    for mode, (r0, r1) in results.items():
        print(f"{mode:<10} {r0:11.1f} {r1:11.1f} {r0 - base0:+8.1f} {r1 - base1:+8.1f} {r0 - r1:+7.1f}")
    gap = results["runlog"][0] - results["runlog"][1]
    print(f"target: run log on, rank 0 - rank 1 <= 4 MiB: {gap:+.1f} MiB {'PASS' if gap <= 4 else 'FAIL'}")


if __name__ == "__main__":
    main()
