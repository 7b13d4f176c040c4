"""Telemetry overhead per step on the reference DDP worker at world size 2, telemetry on vs off.

Run:  python bench/bench_overhead.py            (re-launches itself under torchrun with 2 ranks)
or:   python -m torch.distributed.run --nproc-per-node 2 bench/bench_overhead.py

Three modes, interleaved step by step in a rotating order so drift and neighbours' load hit each alike:

- ``off``:    the worker's own metrics collective (``allgather_dict_into_dict`` of its scalars), no memory keys.
- ``shared``: step window + ``Monitor.collect``: the memory keys ride in the worker's metrics collective (a).
- ``own``:    the worker's own collective, plus a second ``Monitor.collect`` with the memory keys only (b).

Reported: the median step time per mode and the median of each mode's telemetry time (windows + the
collectives) minus ``off``'s collective time, both as a share of the ``off`` step time. The
component figure is the precise one: step time on a shared 2-core machine jitters by more than 1%.
An untimed barrier before the collectives keeps one rank's lag out of both figures.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("off", "shared", "own")


def relaunch() -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "--max-restarts", "0", __file__, *sys.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, timeout=900).returncode


def main() -> None:
    import torch
    import torch.distributed as dist

    import rankmem
    from rankmem.engine.data import ArithmeticSFT
    from rankmem.engine.model import GPT, GPTConfig
    from rankmem.engine.worker import TrainingWorker, WorkerConfig, sft_loss

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60, help="measured steps per mode")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    out_dir = tempfile.mkdtemp(prefix="rankmem_bench_")
    monitor = rankmem.Monitor(out_dir=out_dir, sinks=("jsonl",))  # the run log is part of the cost
    worker = TrainingWorker(GPT(GPTConfig()), WorkerConfig(total_steps=10**6), device=torch.device("cpu"))
    data = ArithmeticSFT(32, 24, args.batch_size)
    step_s: dict[str, list[float]] = {m: [] for m in MODES}
    telemetry_s: dict[str, list[float]] = {m: [] for m in MODES}

    total = args.warmup + args.steps * len(MODES)
    for n in range(total):
        # Rotate the order every round so no mode always follows the same one.
        rnd = n // len(MODES)
        mode = MODES[(n + rnd) % len(MODES)]
        batch = data.batch(worker.rank, n)
        t0 = time.perf_counter()
        tel = 0.0
        worker.monitor = monitor if mode == "shared" else None
        window = monitor.step(n) if mode != "off" else contextlib.nullcontext()
        t = time.perf_counter()
        window.__enter__()
        tel += time.perf_counter() - t
        out = worker.train_batch(batch, sft_loss)
        t_train_end = time.perf_counter()
        window.__exit__(None, None, None)
        tel += time.perf_counter() - t_train_end
        # Untimed: line the ranks up so the collectives' times below are their own cost, not the
        # other rank's lag (which varies by milliseconds on a shared machine, in every mode alike).
        t = time.perf_counter()
        dist.barrier()
        t0 += time.perf_counter() - t
        t = time.perf_counter()
        worker.finish_step(out)
        tel += time.perf_counter() - t
        if mode == "own":
            t = time.perf_counter()
            monitor.collect()
            tel += time.perf_counter() - t
        step_s[mode].append(time.perf_counter() - t0)
        telemetry_s[mode].append(tel)
    monitor.close()

    if dist.get_rank() == 0:
        for m in MODES:  # drop the warmup steps
            k = len(step_s[m]) - args.steps
            step_s[m], telemetry_s[m] = step_s[m][k:], telemetry_s[m][k:]
        base_step = statistics.median(step_s["off"])
        base_tel = statistics.median(telemetry_s["off"])
        print(f"world size 2, DDP, gloo/CPU, {args.steps} steps per mode, interleaved")
        print(f"  off step time (median): {base_step * 1e3:.2f} ms; its metrics collective: {base_tel * 1e3:.3f} ms")
        for m, label in (("shared", "(a) memory keys in the worker's collective"),
                         ("own", "(b) telemetry with its own collective")):
            extra = statistics.median(telemetry_s[m]) - base_tel
            ratio = statistics.median(step_s[m]) / base_step
            print(f"  {label}: +{extra * 1e3:.3f} ms/step = {100 * extra / base_step:.3f}% of step time; "
                  f"step-time ratio on/off {ratio:.4f}")
        a = (statistics.median(telemetry_s["shared"]) - base_tel) / base_step
        print(f"  target (a) < 1%: {'PASS' if a < 0.01 else 'FAIL'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:
        sys.exit(relaunch())
    main()
