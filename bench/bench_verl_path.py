"""rankmem inside verl's metrics path against stock verl's, on the same steps (gloo, CPU), interleaved.

Run:  python bench/bench_verl_path.py                  (world 2, then 4)
      python bench/bench_verl_path.py --worlds 2 --rounds 15 --steps 10

verl 0.9.1's ``TrainingWorker._postprocess_output`` after each mini-batch: the loss all-reduced over the
data-parallel group, the metrics dict (lists of per-micro-batch values) all-gathered with
``verl.utils.torch_functional.allgather_dict_into_dict`` (``all_gather_object`` of the dict), then three
memory figures read after the gather. Two modes run step by step in turn on the reference worker's
SFT step (its compute untimed), the same metrics dict in both:

- ``stock``:   that path as verl has it: the loss all-reduce, verl's own ``allgather_dict_into_dict``
  (compiled from the installed verl's source, as tests/integrations/test_integrations_verl.py does:
  verl's package needs tensordict and ray to import), ``psutil.virtual_memory()`` and, where a device
  exists, its two peak reads;
- ``rankmem``: the path with rankmem in it, as docs/integrations.md says: the step's compute in a
  ``Monitor.step()`` window with a phase, ``metrics_for_gather(monitor)`` merged before the gather,
  rankmem's tensor drop-in ``allgather_dict_into_dict``, and verl's three memory lines gone (rankmem's
  keys carry them, per rank).

Timed: everything either mode adds to the training thread, window edges included, wall and this
thread's CPU time; per round each mode's median step per rank, the ranks averaged; the report gives
the median over rounds and the per-round ratio rankmem / stock. Target (issue 19): below 1.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import gc
import importlib.util
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _torchrun import Clock, run_worker  # type: ignore[import-not-found]

MODES = ("stock", "rankmem")
VERL_KEYS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/entropy",
             "actor/grad_norm_pre_clip")
"""Per-micro-batch metrics of verl's actor update (dp_actor.update_policy), one value per micro-batch."""


def verl_allgather() -> Any:
    """verl's ``allgather_dict_into_dict``, compiled from the installed source file."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("verl is not installed: pip install --no-deps verl==0.9.1 (make install does)")
    path = Path(next(iter(spec.submodule_search_locations))) / "utils/torch_functional.py"
    tree = ast.parse(path.read_text())
    [fn] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "allgather_dict_into_dict"]
    import torch
    import torch.distributed  # noqa: F401 - the function calls torch.distributed.*

    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["allgather_dict_into_dict"]


def worker(args: argparse.Namespace) -> None:
    import psutil
    import torch
    import torch.distributed as dist

    import rankmem
    from rankmem.engine.data import ArithmeticSFT
    from rankmem.engine.model import GPT, GPTConfig
    from rankmem.engine.worker import TrainingWorker, WorkerConfig, sft_loss
    from rankmem.integrations.verl import allgather_dict_into_dict, metrics_for_gather

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    world, rank = dist.get_world_size(), dist.get_rank()
    steps = args.steps or (10 if world <= 2 else 4)
    stock_gather = verl_allgather()
    device = torch.cuda if torch.cuda.is_available() else None
    monitor = rankmem.Monitor(out_dir=tempfile.mkdtemp(prefix="rankmem_bench_"), sinks=("jsonl",))
    worker = TrainingWorker(GPT(GPTConfig()), WorkerConfig(total_steps=10**6, micro_batch_size=8),
                            device=torch.device("cpu"))
    data = ArithmeticSFT(32, 24, args.batch_size)
    per_step: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    rounds: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    clocks: list[Clock] = []
    real_micro_batch = monitor.micro_batch

    def timed_micro_batch(*a: Any, **k: Any) -> None:  # each call into the step's clock
        with clocks[-1]:
            real_micro_batch(*a, **k)

    monitor.micro_batch = timed_micro_batch  # type: ignore[method-assign]
    for n in range(args.warmup + args.rounds * steps * len(MODES)):
        timed = n >= args.warmup
        i = n - args.warmup
        mode = MODES[(i + i // len(MODES)) % len(MODES)] if timed else MODES[n % len(MODES)]
        clock = Clock()
        clocks[:] = [clock]
        worker.monitor = monitor if mode == "rankmem" else None
        window = monitor.step(n) if mode == "rankmem" else contextlib.nullcontext()
        phase = worker.phase("update") if mode == "rankmem" else contextlib.nullcontext()
        with clock:
            window.__enter__()
            phase.__enter__()
        out = worker.train_batch(data.batch(rank, n), sft_loss)
        with clock:
            phase.__exit__(None, None, None)
            window.__exit__(None, None, None)
        # What update_policy leaves in the metrics dict: a value per micro-batch (here 4), grad_norm, lr.
        metrics: dict[str, Any] = {k: [out.loss_sum * (i + 1) for i in range(4)] for k in VERL_KEYS}
        metrics["grad_norm"], metrics["lr"] = torch.tensor(out.grad_norm), out.lr
        losses = [out.loss_sum / 4] * 4
        dist.barrier()  # untimed: line the ranks up
        with clock:
            if mode == "rankmem":
                metrics.update(metrics_for_gather(monitor))
            loss = torch.sum(torch.tensor(losses))
            dist.all_reduce(loss)  # verl's AVG; gloo has SUM only, the same one collective
            loss_value = loss.item() / world
            metrics.pop("grad_norm").detach().item()
            metrics.pop("lr")
            final = (allgather_dict_into_dict if mode == "rankmem" else stock_gather)(metrics, None)
            final["loss"] = loss_value
            if mode == "stock":
                if device is not None:
                    final["perf/max_memory_allocated_gb"] = device.max_memory_allocated() / 2**30
                    final["perf/max_memory_reserved_gb"] = device.max_memory_reserved() / 2**30
                final["perf/cpu_memory_used_gb"] = psutil.virtual_memory().used / 2**30
        if not timed:
            continue
        per_step[mode].append((clock.wall, clock.cpu))
        if len(per_step[mode]) == steps:
            # type: ignore[arg-type]
            rounds[mode].append(tuple(statistics.median(c) for c in zip(*per_step[mode], strict=True)))
            per_step[mode] = []
    monitor.close()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rounds)
    if rank == 0:
        mean = {m: [tuple(statistics.fmean(r[m][k][j] for r in gathered) * 1e3 for j in range(2))
                    for k in range(args.rounds)] for m in MODES}
        print(f"world {world}, gloo/CPU: {args.rounds} interleaved rounds of {steps} steps per mode; per round the "
              "ranks' mean of their median step; median over rounds [IQR]")
        for j, clock_name in enumerate(("wall", "CPU")):
            stock = [r[j] for r in mean["stock"]]
            ours = [r[j] for r in mean["rankmem"]]
            ratio = [o / s for o, s in zip(ours, stock, strict=True)]
            print(f" {clock_name} time (ms) on the training thread: stock verl {_med(stock)}, "
                  f"rankmem in verl's path {_med(ours)}; rankmem / stock per round {_med(ratio, 'x')}: "
                  f"{'PASS' if statistics.median(ratio) < 1 else 'FAIL'} (target < 1)", flush=True)
    del worker
    gc.collect()  # DDP holds the group: freed while the interpreter is whole (rankmem/engine/train.py says why)
    dist.destroy_process_group()


def _med(values: list[float], unit: str = "") -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"{statistics.median(values):.3f}{unit} [{q[0]:.3f}..{q[2]:.3f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=0,
                        help="steps per mode per round (default 10 at world 2, 4 above)")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--worker", action="store_true", help="run as one rank (under torchrun)")
    args = parser.parse_args()
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
