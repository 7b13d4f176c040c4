"""Leak detector quality on generated memory series: recall per leak rate, false-positive rate per null.

Run:  python bench/bench_leaks.py [--trials 100] [--seed 0]

Each series is one rank's host RSS in GiB over N logged steps: a 12 GiB base, a warm-up that adds
1 GiB and levels off (time constant 60 steps), 16 MiB white noise, an AR(1) wander (phi 0.95, 3 MiB
innovations, ~10 MiB stationary sd), and 1% one-step spikes of 200-500 MiB (checkpoint saves,
rollouts). Leaks add a constant rate from step 0. Nulls: flat, warm-up then flat, a sawtooth (a
cache that fills and is freed every 100 steps), and one permanent +100 MiB jump in the second half
(a cache that grows once: not a leak, and reported separately because only the level-shift check
stops it being flagged).

Then the online check's cost on the logging rank, where every other rank waits for it at the next
collective: a full LeakWatch (2000 buffered collects, the 3 baseline keys among 28) per collect over
one round of tests, and all series tested at once.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from rankmem.leaks import LEAK_KEYS, LeakConfig, LeakWatch, trend

MIB = 1 / 1024
RATES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
LENGTHS = (400, 1000)


def base(n: int, rng: np.random.Generator, warmup: bool = True) -> np.ndarray:
    t = np.arange(n)
    y = 12.0 + (1.0 - np.exp(-t / 60.0)) * (1.0 if warmup else 0.0)
    y += rng.normal(0, 16, n) * MIB
    wander = np.zeros(n)
    shocks = rng.normal(0, 3, n)
    for i in range(1, n):
        wander[i] = 0.95 * wander[i - 1] + shocks[i]
    y += wander * MIB
    spikes = rng.random(n) < 0.01
    y += spikes * rng.uniform(200, 500, n) * MIB
    return y


def null(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "flat":
        return base(n, rng, warmup=False)
    y = base(n, rng)
    if kind == "sawtooth":
        y += (np.arange(n) % 100) * 2.0 * MIB  # +200 MiB, freed every 100 steps
    elif kind == "one jump":
        y[rng.integers(n // 2, n) :] += 100 * MIB
    return y


def online_cost(world: int, rng: np.random.Generator) -> tuple[float, float, float]:
    """(median, max) ms per collect over one round of ``check_every`` collects, and ms per full check()."""
    watch = LeakWatch()
    keys = sorted([*LEAK_KEYS, *(f"mem/other/k{i}_gib" for i in range(25))])
    feeds = []
    for step in range(watch.capacity + watch.check_every):
        matrix = 12.0 + rng.normal(0, 16, (world, len(keys))) * MIB
        t0 = time.perf_counter()
        watch.feed_matrix(step, keys, matrix)
        feeds.append(time.perf_counter() - t0)
    round_ = np.array(feeds[-watch.check_every :]) * 1e3
    t0 = time.perf_counter()
    watch.check()
    return float(np.median(round_)), float(round_.max()), (time.perf_counter() - t0) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    config = LeakConfig()
    print(f"leak detector: window last {config.window:.0%}, alpha {config.alpha}, min growth {config.min_growth_mib:g} MiB; "
          f"{args.trials} series per cell")
    print(f"{'series':<22}" + "".join(f"{f'N={n} steps':>16}" for n in LENGTHS))
    timings: list[float] = []

    def rate_of(make: object, n: int) -> float:
        hits = 0
        for _ in range(args.trials):
            y = make(n)  # type: ignore[operator]
            t0 = time.perf_counter()
            t = trend(np.arange(n), y, "mem/host/rss_gib", 0, config)
            timings.append(time.perf_counter() - t0)
            hits += bool(t is not None and t.leak)
        return hits / args.trials

    for r in RATES:
        cells = [rate_of(lambda n, r=r: base(n, rng) + np.arange(n) * r * MIB, n) for n in LENGTHS]
        print(f"{f'leak {r:g} MiB/step':<22}" + "".join(f"{f'recall {c:.0%}':>16}" for c in cells))
    for kind in ("flat", "warm-up then flat", "sawtooth", "one jump"):
        cells = [rate_of(lambda n, k=kind: null(k, n, rng), n) for n in LENGTHS]
        print(f"{kind:<22}" + "".join(f"{f'flagged {c:.0%}':>16}" for c in cells))
    print(f"time per rank series: median {np.median(timings) * 1e3:.2f} ms, max {np.max(timings) * 1e3:.2f} ms")
    for world in (8, 64):
        median, worst, full = online_cost(world, rng)
        print(f"online, world {world}: per collect median {median:.2f} ms, max {worst:.2f} ms; "
              f"all {len(LEAK_KEYS) * world} series at once {full:.0f} ms")


if __name__ == "__main__":
    main()
