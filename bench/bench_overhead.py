"""Telemetry cost on the training thread of the reference DDP worker (gloo, CPU), in interleaved rounds.

Run:  python bench/bench_overhead.py                 (world 2 then world 4, each under its own torchrun)
      python bench/bench_overhead.py --worlds 2 --rounds 15 --steps 10
or:   python -m torch.distributed.run --nproc-per-node 2 bench/bench_overhead.py --worker

Six modes run step by step in a rotating order, so drift and a neighbour's load hit each alike:

- ``off``:    the worker's own metrics collective (``allgather_dict_into_dict`` of its scalars), no memory keys.
- ``shared``: step window + ``Monitor.collect``: the memory keys ride in the worker's metrics collective (a).
- ``work``:   ``shared`` with the step's compute in a phase (``update``), as the reference tasks run it:
  the worker tells the phase each micro-batch (``Monitor.micro_batch``), the work fields.
- ``nowork``: ``work`` with ``Monitor.micro_batch`` a no-op, so the phase carries no work keys
  (c: what the work fields cost, ``work`` minus this).
- ``own``:    the worker's own collective, then a second ``Monitor.collect`` of the memory keys alone (b).
- ``bare``:   the worker's own collective, then a bare ``all_gather_into_tensor`` of a float64 vector as
  long as the one ``own``'s collect sends (its keys plus rankmem's 3-value header): (b)'s yardstick.

Component time is the time spent inside the telemetry calls on the training thread (window edges,
``collect``, the worker's collective), timed directly: the whole step jitters by more than the
telemetry costs on a shared 2-core machine. Two clocks: wall time, the targets' measure, which holds
the waits in the collectives and any preemption by other processes; and the training thread's CPU
time, which holds neither and so jitters far less. Each mode's steps in a round give one median per
rank; the ranks' medians averaged are the round's figure (a rank's time in a collective already holds
its wait for the last rank to arrive); the report gives the median over rounds and their spread. An
untimed barrier before the collectives keeps one rank's lag out of every figure. The run log
(``jsonl``) and the online leak watch are on, as by default: their background thread's share of the
GIL and the CPUs is part of what the training thread feels.

Targets (issue 14, item 4): (a) at most 0.1 ms per step over ``off`` at world 2; (b) ``own``'s
``collect()`` at most 1.2x the bare all-gather, at world 2 and 4.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import statistics
import sys
import tempfile
from typing import Any

from _torchrun import Clock, run_worker  # type: ignore[import-not-found]

MODES = ("off", "shared", "work", "nowork", "own", "bare")
A_TARGET_MS = 0.1
B_TARGET = 1.2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="world sizes, one torchrun each")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (the spread is over them)")
    parser.add_argument("--steps", type=int, default=0, help="steps per mode per round (default: 20 at world "
                        "2, 4 at larger worlds, where 2 cores run the ranks in turn)")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps first (the first collects learn "
                        "the layout through the pickled path)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--worker", action="store_true", help="run as one rank (under torchrun)")
    return parser.parse_args()


def spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"IQR {q[0]:.3f}..{q[2]:.3f}, min..max {min(values):.3f}..{max(values):.3f}"


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import rankmem
    from rankmem.engine.data import ArithmeticSFT
    from rankmem.engine.model import GPT, GPTConfig
    from rankmem.engine.worker import TrainingWorker, WorkerConfig, sft_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    world = dist.get_world_size()
    steps = args.steps or (20 if world <= 2 else 4)
    # One monitor per mode: each collect's vector is as long as its own keys (a monitor's gather keeps
    # the longest layout it has seen as its capacity).
    monitors = {m: rankmem.Monitor(out_dir=tempfile.mkdtemp(prefix="rankmem_bench_"), sinks=("jsonl",))
                for m in ("shared", "work", "nowork", "own")}
    # Each micro_batch call is timed into the step's clock (``spent``), the work monitor's real, the
    # nowork monitor's a no-op: the two differ by what the calls and the keys they add cost.
    spent_now: list[Clock] = []
    real_micro_batch = monitors["work"].micro_batch

    def timed_micro_batch(*a: Any, real: Any = None, **k: Any) -> None:
        with spent_now[-1]:
            if real is not None:
                real(*a, **k)

    monitors["work"].micro_batch = functools.partial(timed_micro_batch, real=real_micro_batch)  # type: ignore[method-assign]
    monitors["nowork"].micro_batch = timed_micro_batch  # type: ignore[method-assign]
    worker = TrainingWorker(GPT(GPTConfig()), WorkerConfig(total_steps=10**6), device=torch.device("cpu"))
    data = ArithmeticSFT(32, 24, args.batch_size)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    bare_in: torch.Tensor | None = None
    bare_out: torch.Tensor | None = None

    # Per mode and step: (wall, CPU) of all its telemetry calls, then of the collective under test; per
    # round, the median of each of the four.
    steps_of: dict[str, list[tuple[float, ...]]] = {}
    rounds: dict[str, list[tuple[float, ...]]] = {m: [] for m in MODES}
    total = args.warmup + args.rounds * steps * len(MODES)
    for n in range(total):
        timed = n >= args.warmup
        i = n - args.warmup
        mode = MODES[(i + i // len(MODES)) % len(MODES)] if timed else ("shared", "work", "nowork", "own")[n % 4]
        batch = data.batch(worker.rank, n)
        monitor = monitors.get(mode)
        worker.monitor = monitor if mode in ("shared", "work", "nowork") else None
        window = monitor.step(n) if monitor is not None else contextlib.nullcontext()
        spent = Clock()
        spent_now[:] = [spent]
        phase = worker.phase("update") if mode in ("work", "nowork") else contextlib.nullcontext()
        with spent:
            window.__enter__()
            phase.__enter__()
        out = worker.train_batch(batch, sft_loss)
        with spent:
            phase.__exit__(None, None, None)
            window.__exit__(None, None, None)
        dist.barrier()  # untimed: line the ranks up
        with spent:
            worker.finish_step(out)
        collective = Clock()
        if mode == "own" and monitor is not None:
            with collective:
                got = monitor.collect()
            if bare_in is None:  # as long as what collect sends: its keys and the 3-value header
                width = sum(k.endswith("/max_rank") for k in got) + 3
                bare_in = torch.zeros(width, dtype=torch.float64)
                bare_out = torch.empty(world * width, dtype=torch.float64)
        elif mode == "bare" and bare_in is not None:
            with collective:
                all_gather(bare_out, bare_in)
                bare_out.numpy()  # type: ignore[union-attr]
        if not timed:
            continue
        steps_of.setdefault(mode, []).append((spent.wall + collective.wall, spent.cpu + collective.cpu,
                                              collective.wall, collective.cpu))
        if len(steps_of[mode]) == steps:
            rounds[mode].append(tuple(statistics.median(col) for col in zip(*steps_of.pop(mode), strict=True)))
    for monitor in monitors.values():
        monitor.close()

    # Per round and mode, the ranks' medians averaged: each rank's time already holds its wait for the last one.
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, rounds)
    if dist.get_rank() == 0:
        per_rank: list[dict[str, list[tuple[float, ...]]]] = gathered  # type: ignore[assignment]
        mean = {m: [tuple(statistics.fmean(r[m][k][j] for r in per_rank) * 1e3 for j in range(4))
                    for k in range(args.rounds)] for m in MODES}
        print(f"world {world}, DDP, gloo/CPU: {args.rounds} interleaved rounds of {steps} steps per mode; per "
              "round, the ranks' mean of their median step; figures: median over rounds [spread]")
        report(world, mean, "wall", 0)
        report(world, mean, "CPU", 1)
    dist.destroy_process_group()


def report(world: int, rounds: dict[str, list[tuple[float, ...]]], clock: str, j: int) -> None:
    """One clock's figures: ``j`` 0 is wall time (the targets'), 1 the training thread's CPU time."""
    off = [r[j] for r in rounds["off"]]
    shared = [r[j] - o for r, o in zip(rounds["shared"], off, strict=True)]
    own_total = [r[j] - o for r, o in zip(rounds["own"], off, strict=True)]
    own = [r[j + 2] for r in rounds["own"]]
    bare = [r[j + 2] for r in rounds["bare"]]
    ratio = [c / b for c, b in zip(own, bare, strict=True)]
    med = statistics.median
    print(f" {clock} time (ms) on the training thread")
    print(f"  off: the worker's metrics collective {med(off):.3f} [{spread(off)}]")
    print(f"  (a) shared, memory keys in the worker's collective: {med(shared):+.3f} per step [{spread(shared)}]")
    work = [r[j] - w[j] for r, w in zip(rounds["work"], rounds["nowork"], strict=True)]
    print(f"  (c) the work fields (micro_batch calls, their keys in the collective): {med(work):+.3f} per step "
          f"[{spread(work)}]")
    print(f"  (b) own collect() {med(own):.3f} [{spread(own)}]; bare all-gather of the same vector "
          f"{med(bare):.3f} [{spread(bare)}]")
    print(f"      own/bare per round {med(ratio):.2f}x [{spread(ratio)}]; windows + own collect over off: "
          f"{med(own_total):+.3f} per step [{spread(own_total)}]")
    a, b = med(shared), med(ratio)
    if world == 2:
        print(f"  target (a) <= {A_TARGET_MS} ms/step at world 2, {clock} time: "
              f"{'PASS' if a <= A_TARGET_MS else 'FAIL'} ({a:.3f} ms)")
    print(f"  target (b) <= {B_TARGET}x a bare all-gather at world {world}, {clock} time: "
          f"{'PASS' if b <= B_TARGET else 'FAIL'} ({b:.2f}x)", flush=True)


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    for world in args.worlds:
        rc = run_worker(__file__, world, sys.argv[1:])
        if rc != 0:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
