"""The collective's cost as the world grows: measured on gloo up to W = 16, modelled up to 16,384.

    python bench/bench_scale.py                  # gloo W = 2, 4, 8, 16 + local CPU up to 16,384; table + PNG
    python bench/bench_scale.py --worlds 2 4     # fewer launches
    python bench/bench_scale.py --png out.png    # where the figure goes (default bench/scale.png)

Part 1 launches torchrun per world (gloo on loopback; on a 2-core machine W > 2 is oversubscribed, so
latency there grows with W from CPU contention as much as from the algorithm) and times per collect,
interleaved in rounds (median round, max over ranks): rankmem's all-gather path
(``Exchange.gather_aggregate`` below the crossover), its all-reduce path (forced: three all-reduces,
no detail), a gather of the same vector to rank 0 only (+ aggregate there), and a bare one-float
all-gather and all-reduce (the per-op latency alpha).

Part 2 times, in this process, the work that grows with W on a rank: ``aggregate`` over a W x K
matrix, ``Gathered.columns()`` (the run log's per-rank lists) and the JSON encoding of one run-log
line with and without the per-rank vectors, for W up to 16,384; and the all-reduce path's local
work (its packing and unpacking, collectives stubbed), which does not depend on W.

Part 3 fits the alpha-beta-gamma model (RESULTS.md, "Scale") and prints the crossover.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Callable

from _torchrun import free_port, worker_result

KEYS = 64
BINS = 32  # Exchange's default quantile_bins: the SUM vector carries K x BINS histogram counts
ROUNDS = 5


def _timed(cases: dict[str, Callable[[], object]], iters: int, barrier: Callable[[], object]) -> dict[str, float]:
    rounds: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(ROUNDS):
        for name, fn in cases.items():
            barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            rounds[name].append((time.perf_counter() - start) / iters * 1e6)
    return {k: sorted(v)[len(v) // 2] for k, v in rounds.items()}


def worker() -> None:
    import torch
    import torch.distributed as dist

    from rankmem.exchange.aggregate import aggregate
    from rankmem.exchange.exchange import Exchange

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    data = {f"mem/key_{i:02d}_gib": float(rank * 1000 + i) for i in range(KEYS)}
    keys = tuple(sorted(data))
    gather = Exchange(reduce_above=10**9)
    reduce = Exchange(reduce_above=1, detail_every=10**9)
    for ex in (gather, reduce):
        ex.gather_aggregate(data, 0)  # learn the layout, as the first collect does
        ex.gather_aggregate(data, 1)  # reduce: collect 0 of the cadence carries the detail; not timed
    one_in = torch.tensor([0.0, 0.0, 0.0, *data.values()], dtype=torch.float64)
    one_out = [torch.empty_like(one_in) for _ in range(world)] if rank == 0 else None
    tiny, tiny_out = torch.zeros(1, dtype=torch.float64), torch.zeros(world, dtype=torch.float64)

    def to_one() -> None:
        dist.gather(one_in, one_out, dst=0)
        if one_out is not None:
            aggregate(keys, torch.stack(one_out).numpy()[:, 3:])

    cases: dict[str, Callable[[], object]] = {
        "allgather": lambda: gather.gather_aggregate(data, 2),
        "reduce": lambda: reduce.gather_aggregate(data, 2),
        "gather_to_one": to_one,
        "alpha_ag": lambda: dist.all_gather_into_tensor(tiny_out, tiny),
        "alpha_ar": lambda: dist.all_reduce(tiny),
    }
    iters = max(20, 400 // world)
    median = _timed(cases, iters, dist.barrier)
    t = torch.tensor(list(median.values()), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # every rank waits on the slowest
    if rank == 0:
        print(json.dumps({"world": world, **dict(zip(cases, t.tolist(), strict=True))}))
    assert gather.packed.fallbacks == 1 and reduce.packed.fallbacks == 1, "pickling in steady state"
    dist.destroy_process_group()


def measure_gloo(worlds: list[int]) -> list[dict[str, float]]:
    out = []
    for world in worlds:
        out.append(worker_result(__file__, world))
    return out


def measure_local(worlds: list[int]) -> list[dict[str, float]]:
    """Per-rank CPU work that grows with W (all-gather path, and the logging rank's line), in us."""
    import numpy as np

    from rankmem.exchange.aggregate import Gathered, aggregate
    from rankmem.runlog.layout import SEPARATORS, STEP_KIND

    def step_object(step: int, when: float, agg: dict[str, float], cols: dict[str, list[float]]) -> dict[str, object]:
        # The run log's line holds the aggregates; "json_full" is what a line with the per-rank vectors
        # would cost (the side file's float64 records replaced it).
        return {"kind": STEP_KIND, "step": step, "time": when, "metrics": agg, **({"ranks": cols} if cols else {})}

    keys = [f"mem/key_{i:02d}_gib" for i in range(KEYS)]
    rng = np.random.default_rng(0)
    rows = []
    for world in worlds:
        matrix = rng.random((world, KEYS)) * 80
        agg = aggregate(keys, matrix)
        g = Gathered(keys, matrix, agg, mixed=False)
        cols = g.columns()
        iters = max(3, 20000 // world)
        t = _timed({
            "aggregate": lambda: aggregate(keys, matrix),  # noqa: B023 - timed in this iteration
            "columns": g.columns,
            "json_full": lambda: json.dumps(step_object(1, 0.0, agg, cols), separators=SEPARATORS),  # noqa: B023
            "json_agg": lambda: json.dumps(step_object(1, 0.0, agg, {}), separators=SEPARATORS),  # noqa: B023
        }, iters, lambda: None)
        line = len(json.dumps(step_object(1, 0.0, agg, cols), separators=SEPARATORS))
        rows.append({"world": world, **t, "line_bytes": line,
                     "line_agg_bytes": len(json.dumps(step_object(1, 0.0, agg, {}), separators=SEPARATORS))})
    return rows


def measure_reduce_local() -> float:
    """The all-reduce path's own CPU work per collect (pack 3 vectors, unpack, build the dict), in us:
    collectives stubbed to identity in a world-of-one gloo group, with W set to 16,384 (no effect)."""
    import torch.distributed as dist

    from rankmem.exchange.exchange import Exchange

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ex = Exchange(reduce_above=1, detail_every=10**9)
    data = {f"mem/key_{i:02d}_gib": float(i) for i in range(KEYS)}
    packed = ex.packed
    packed._world, packed._backend = 16384, "gloo"
    packed._follow_device()
    packed.capacity = KEYS
    ex._collects = 1
    ex.reduce._all_reduce = lambda pair, op: pair[0].numpy()  # type: ignore[method-assign]
    t = _timed({"reduce_local": lambda: ex.gather_aggregate(data, 1)}, 2000, lambda: None)
    dist.destroy_process_group()
    return t["reduce_local"]


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs) or 1.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, b


# The NCCL side of the model is not measurable here (no GPU): its constants are assumptions, stated.
NCCL_ALPHA_NET_US = 8.0  # one inter-node step of a small-message ring or tree (IB, host-initiated)
NCCL_ALPHA_NVL_US = 1.5  # one intra-node NVLink step
NCCL_BW_NET = 25e9  # bytes/s per rank across nodes (200 Gb/s NIC per GPU)
GPUS_PER_NODE = 8
D2H_US = 10.0  # the device-to-host copy that NCCL results take before numpy (one sync)


def model_nccl(world: int, k: int, gamma_us: float, reduce_local_us: float) -> dict[str, float]:
    """Per-collect latency on one rank, us, from the alpha-beta-gamma model with the NCCL constants above."""
    nodes = max(1, world // GPUS_PER_NODE)
    s = 8 * (k + 3)  # one rank's packed vector, bytes
    ring_steps = (nodes - 1) * NCCL_ALPHA_NET_US + (min(world, GPUS_PER_NODE) - 1) * NCCL_ALPHA_NVL_US
    tree_steps = (2 * math.log2(max(nodes, 1)) * NCCL_ALPHA_NET_US
                  + 2 * math.log2(min(world, GPUS_PER_NODE)) * NCCL_ALPHA_NVL_US)
    ag = ring_steps + (world - 1) * s / NCCL_BW_NET * 1e6 + D2H_US + gamma_us * world * k
    ar_bytes = 8 * (6 + 3 * k + (2 + BINS) * k + 3 * k)
    red = 3 * (min(ring_steps * 2, tree_steps) + 2 * ar_bytes / 3 / NCCL_BW_NET * 1e6 + D2H_US) + reduce_local_us
    # Gather to the logging rank: its receive is serial in W (NCCL gather is W-1 sends to one peer);
    # the other ranks still need the aggregates back: one broadcast of 5K floats.
    one = ((world - 1) * (NCCL_ALPHA_NVL_US / 4 + s / NCCL_BW_NET * 1e6) + tree_steps / 2 + D2H_US * 2
           + gamma_us * world * k)
    # Hierarchical: an NVLink all-gather in the node, partial aggregates, an all-gather of those across nodes.
    hier = ((GPUS_PER_NODE - 1) * NCCL_ALPHA_NVL_US + (nodes - 1) * NCCL_ALPHA_NET_US
            + (nodes - 1) * 8 * 5 * k / NCCL_BW_NET * 1e6 + 2 * D2H_US + gamma_us * (GPUS_PER_NODE + nodes) * k)
    return {"allgather": ag, "reduce": red, "gather_to_one": one, "hierarchical": hier}


def bytes_per_rank(world: int, k: int) -> dict[str, float]:
    """Bytes a rank receives per collect (ring algorithms; the root's receive for gather-to-one)."""
    s = 8 * (k + 3)
    ar = 8 * (6 + 3 * k + (2 + BINS) * k + 3 * k)
    return {"allgather": (world - 1) * s, "reduce": 2 * (world - 1) / world * ar,
            "gather_to_one": (world - 1) * s,
            "hierarchical": (GPUS_PER_NODE - 1) * s + (world // GPUS_PER_NODE) * 40 * k}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4, 8, 16])
    parser.add_argument("--png", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "scale.png"))
    args = parser.parse_args()

    gloo = measure_gloo(args.worlds)
    print(f"gloo, K={KEYS}, {os.cpu_count()} cores (W > cores is oversubscribed), us per collect, max over ranks:")
    print(f"{'W':>5s} {'allgather':>10s} {'reduce':>8s} {'to_one':>8s} {'alpha_ag':>9s} {'alpha_ar':>9s} "
          f"{'recv B ag':>10s} {'recv B red':>11s}")
    for r in gloo:
        w = int(r["world"])
        b = bytes_per_rank(w, KEYS)
        print(f"{w:5d} {r['allgather']:10.1f} {r['reduce']:8.1f} {r['gather_to_one']:8.1f} {r['alpha_ag']:9.1f} "
              f"{r['alpha_ar']:9.1f} {b['allgather']:10.0f} {b['reduce']:11.0f}")

    local_worlds = [2, 8, 64, 512, 1024, 4096, 16384]
    local = measure_local(local_worlds)
    reduce_local = measure_reduce_local()
    print(f"\nlocal CPU, K={KEYS}, us (one process): reduce path's own work {reduce_local:.1f} us at any W")
    print(f"{'W':>6s} {'aggregate':>10s} {'columns':>10s} {'json full':>10s} {'json agg':>9s} {'line B':>10s} "
          f"{'agg line B':>11s}")
    for r in local:
        print(f"{int(r['world']):6d} {r['aggregate']:10.1f} {r['columns']:10.1f} {r['json_full']:10.1f} "
              f"{r['json_agg']:9.1f} {int(r['line_bytes']):10d} {int(r['line_agg_bytes']):11d}")

    # gamma: the all-gather path's per-(rank x key) CPU on every rank (aggregate), fitted on the large W.
    big = [r for r in local if r["world"] >= 512]
    gamma = fit([r["world"] * KEYS for r in big], [r["aggregate"] for r in big])[1]
    gamma_log = fit([r["world"] * KEYS for r in big], [r["columns"] + r["json_full"] for r in big])[1]
    ws = [float(r["world"]) for r in gloo]
    ag_fit = fit(ws, [r["allgather"] for r in gloo])
    red_fit = fit(ws, [r["reduce"] for r in gloo])
    print(f"\nfits: gamma(aggregate) {gamma * 1e3:.2f} ns per rank x key; logging rank's columns + JSON "
          f"{gamma_log * 1e3:.1f} ns per rank x key")
    print(f"gloo loopback fits (W <= {max(args.worlds)}): allgather {ag_fit[0]:.0f} + {ag_fit[1]:.1f} W us; "
          f"reduce {red_fit[0]:.0f} + {red_fit[1]:.1f} W us")
    gloo_cross = ((red_fit[0] - ag_fit[0]) / (ag_fit[1] - red_fit[1])
                  if ag_fit[1] > red_fit[1] else math.inf)
    print(f"gloo crossover (extrapolated): W = {gloo_cross:.0f}")
    model_ws = [2 ** i for i in range(1, 15)]
    curves = {w: model_nccl(w, KEYS, gamma, reduce_local) for w in model_ws}
    cross = next((w for w in model_ws if curves[w]["reduce"] < curves[w]["allgather"]), math.inf)
    print(f"NCCL model (assumed constants, see RESULTS.md), K={KEYS}, us per collect:")
    print(f"{'W':>6s} {'allgather':>10s} {'reduce':>8s} {'to_one':>8s} {'hier':>8s} {'recv B ag':>10s} "
          f"{'recv B red':>11s}")
    for w in model_ws:
        c, b = curves[w], bytes_per_rank(w, KEYS)
        print(f"{w:6d} {c['allgather']:10.1f} {c['reduce']:8.1f} {c['gather_to_one']:8.1f} {c['hierarchical']:8.1f} "
              f"{b['allgather']:10.0f} {b['reduce']:11.0f}")
    print(f"NCCL model crossover: reduce cheaper from W = {cross}")
    plot(args.png, gloo, local, curves)
    print(f"figure: {args.png}")


def plot(path: str, gloo: list[dict[str, float]], local: list[dict[str, float]],
         curves: dict[int, dict[str, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    ws = sorted(curves)
    for name, style in (("allgather", "-"), ("reduce", "--"), ("gather_to_one", ":"), ("hierarchical", "-.")):
        left.plot(ws, [curves[w][name] for w in ws], style, label=f"{name} (NCCL model)")
    for name, marker in (("allgather", "o"), ("reduce", "s"), ("gather_to_one", "^")):
        left.plot([r["world"] for r in gloo], [r[name] for r in gloo], marker, label=f"{name} (gloo, measured)")
    left.set(xscale="log", yscale="log", xlabel="world size W", ylabel="us per collect (one rank)",
             title="collective + per-rank CPU, K = 64")
    left.legend(fontsize=7)
    lw = [r["world"] for r in local]
    right.plot(lw, [r["aggregate"] for r in local], "o-", label="aggregate W x K (every rank, all-gather path)")
    right.plot(lw, [r["columns"] for r in local], "s-", label="Gathered.columns() (logging rank)")
    right.plot(lw, [r["json_full"] for r in local], "^-", label="JSON line with per-rank vectors")
    right.plot(lw, [r["json_agg"] for r in local], "v--", label="JSON line, aggregates only")
    right.set(xscale="log", yscale="log", xlabel="world size W", ylabel="us (measured, one process)",
              title="local CPU per collect, K = 64")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        main()
