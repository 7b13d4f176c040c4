"""Leak detector quality on generated memory series, offline and online: recall per leak rate, flags
per null; then what the online watch costs the logging rank.

Run:  python bench/bench_leaks.py [--trials 200] [--seed 0] [--quick]

Each series is one rank's host RSS in GiB over N logged steps: a 12 GiB base, a 1 GiB warm-up that
levels off (time constant 7 steps: under 1 MiB is left to grow by step 50), 1% one-step spikes of
200-500 MiB (checkpoint saves, rollouts), white noise and an AR(1) wander (phi 0.95), at two levels:

- ``steady``: 4 MiB white noise, 0.6 MiB wander innovations (~2 MiB stationary sd). Still noisier
  than the reference worker's own RSS (``rankmem train --task grpo``: step-to-step changes 0 MiB in the
  median, 0.8 MiB sd over 150 steps).
- ``noisy``: 16 MiB white noise, 3 MiB innovations (~10 MiB sd): a job whose buffers vary with its
  batches. The wander alone then moves a 50-step window by ~20 MiB, so at N=100 no rule can tell a
  1 MiB/step leak from it without false alarms; this profile is shown from N=400.

Leaks add a constant rate from step 0. Nulls, none of which is a leak: flat (no warm-up); warm-up
then flat; a sawtooth (a cache that fills to 100 MiB over 25 steps and is freed); one permanent
+100 MiB jump in the second half; a staircase of three +50..100 MiB jumps after N/4. Last, a limit
rather than a null: a slow sawtooth, filling 200 MiB over 100 steps. Offline its cycles lie inside the
window; online, a window shorter than a cycle sees 100 steps of steady growth before the cache is freed,
so it is flagged early in the run: no detector can tell the two apart before the give-back.

Then what real jobs showed: the same leaks with a step end's +-40 MiB spikes on a third of the steps
(``spiky``), a leak that stops at 94% of the run (``stopped``, spiky too), and a children's RSS leak as
the node thread reads it, every 22 steps, repeated in between (``children``: a staircase, low noise);
and the nulls among them: a spiky flat series, a spiky one-off +100 MiB jump, a refreshed flat children
figure and a refreshed one with one jump.

Offline is :func:`rankmem.offline.leaks.trend`'s verdict on the whole run (all seeds of a cell as the ranks of
one :func:`~rankmem.offline.leaks.trends` call, as ``rankmem leaks`` judges them). Online is a
:class:`~rankmem.offline.leaks.LeakWatch` with its defaults fed the run one collect at a time, the seeds as its
ranks; a series counts as flagged if the watch warned at any point of the run. No capacity is known
for these series, so the stakes floor is ``min_growth_mib``.

Then the online check's cost on the logging rank, where every other rank waits for it at the next
collective: a full LeakWatch (2000 buffered collects, the 3 baseline keys among 28) per collect over
a round of tests, and all series tested at once.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

import numpy as np

from rankmem.offline.leaks import LEAK_KEYS, LeakConfig, LeakWatch, trends

MIB = 1 / 1024
RSS = "mem/host/rss_gib"
CHILDREN = "mem/host/children_rss_gib"
REFRESH = 22
RATES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
PROFILES = {"steady": (4.0, 0.6, (100, 400, 1000)), "noisy": (16.0, 3.0, (400, 1000))}
NULLS = ("flat", "warm-up then flat", "sawtooth", "one jump", "staircase", "slow sawtooth (limit)")

Make = Callable[[int, np.random.Generator], np.ndarray]


def base(n: int, rng: np.random.Generator, profile: str, warmup: bool = True) -> np.ndarray:
    white, innovation, _ = PROFILES[profile]
    t = np.arange(n)
    y = 12.0 + (1.0 - np.exp(-t / 7.0)) * (1.0 if warmup else 0.0)
    y += rng.normal(0, white, n) * MIB
    shocks = rng.normal(0, innovation, n)
    wander = np.zeros(n)
    for i in range(1, n):
        wander[i] = 0.95 * wander[i - 1] + shocks[i]
    y += wander * MIB
    spikes = rng.random(n) < 0.01
    return y + spikes * rng.uniform(200, 500, n) * MIB


def leak(rate: float, profile: str) -> Make:
    return lambda n, rng: base(n, rng, profile) + np.arange(n) * rate * MIB


def null(kind: str, profile: str) -> Make:
    def make(n: int, rng: np.random.Generator) -> np.ndarray:
        if kind == "flat":
            return base(n, rng, profile, warmup=False)
        y = base(n, rng, profile)
        if kind == "sawtooth":
            y += (np.arange(n) % 25) * 4.0 * MIB
        elif kind.startswith("slow sawtooth"):
            y += (np.arange(n) % 100) * 2.0 * MIB
        elif kind == "one jump":
            y[rng.integers(n // 2, n) :] += 100 * MIB
        elif kind == "staircase":
            for at in rng.integers(n // 4, n, 3):
                y[at:] += rng.uniform(50, 100) * MIB
        return y

    return make


def spiky(make: Make) -> Make:
    def spiked(n: int, rng: np.random.Generator) -> np.ndarray:
        return make(n, rng) + (rng.random(n) < 1 / 3) * rng.choice([-40.0, 40.0], n) * MIB
    return spiked


def stopped(rate: float) -> Make:
    return spiky(lambda n, rng: base(n, rng, "steady") + np.minimum(np.arange(n), int(0.94 * n)) * rate * MIB)


def refreshed(rate: float, jump: bool = False) -> Make:
    """A children figure read every ``REFRESH`` steps: 1 GiB, 1 MiB of noise, ``rate`` MiB/step."""
    def make(n: int, rng: np.random.Generator) -> np.ndarray:
        y = 1.0 + (rng.normal(0, 1, n) + np.arange(n) * rate) * MIB
        if jump:
            y[rng.integers(n // 2, n) :] += 100 * MIB
        return y[(np.arange(n) // REFRESH) * REFRESH]
    return make


def offline(columns: np.ndarray, config: LeakConfig, key: str = RSS) -> float:
    found = trends(np.arange(columns.shape[0]), columns, key, range(columns.shape[1]), config)
    return sum(t.leak for t in found) / columns.shape[1]


def online(columns: np.ndarray, key: str = RSS) -> float:
    watch = LeakWatch(keys=(key,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one warning per flagged seed
        for step in range(columns.shape[0]):
            watch.feed_matrix(step, (key,), columns[step][:, None], when=float(step))
    return len(watch.flagged) / columns.shape[1]


def online_cost(world: int, rng: np.random.Generator) -> tuple[float, float, float]:
    """(median, max) ms per collect over one round of ``check_every`` collects, and ms per full check()."""
    watch = LeakWatch()
    keys = sorted([*LEAK_KEYS, *(f"mem/other/k{i}_gib" for i in range(25))])
    feeds = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(watch.capacity + watch.check_every):
            matrix = 12.0 + rng.normal(0, 16, (world, len(keys))) * MIB
            t0 = time.perf_counter()
            watch.feed_matrix(step, keys, matrix)
            feeds.append(time.perf_counter() - t0)
        round_ = np.array(feeds[-watch.check_every :]) * 1e3
        early = np.array(feeds[: 4 * watch.warmup]) * 1e3  # the first tests, every few collects
        t0 = time.perf_counter()
        watch.check()
    return float(np.median(round_)), float(max(round_.max(), early.max())), (time.perf_counter() - t0) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=200, help="series (seeds) per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="skip the online columns")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    config = LeakConfig()
    print(f"leak detector: window last {config.window:.0%}, alpha {config.alpha}, growth over "
          f"{config.noise_factor:g} x noise + {config.min_growth_mib:g} MiB; {args.trials} series per cell; "
          "offline / online")
    elapsed = time.perf_counter()
    real: list[tuple[str, Make, str, str]] = [
        (f"leak {r:g} MiB/step", spiky(leak(r, "steady")), "recall", RSS) for r in (1.0, 2.0)]
    real += [(f"leak {r:g} stops at 94%", stopped(r), "recall", RSS) for r in (1.0, 2.0)]
    real += [("flat", spiky(null("flat", "steady")), "flagged", RSS),
             ("one jump", spiky(null("one jump", "steady")), "flagged", RSS),
             ("sawtooth", spiky(null("sawtooth", "steady")), "flagged", RSS)]
    real += [(f"leak {r:g} MiB/step", refreshed(r), "recall", CHILDREN) for r in (1.0, 1.5)]
    real += [("flat", refreshed(0.0), "flagged", CHILDREN),
             ("one jump", refreshed(0.0, True), "flagged", CHILDREN)]
    tables = []
    for p, (*_, ns) in PROFILES.items():
        rows = [(f"leak {r:g} MiB/step", leak(r, p), "recall", RSS) for r in RATES]
        tables.append((p, rows + [(kind, null(kind, p), "flagged", RSS) for kind in NULLS], ns))
    tables += [("spiky", real[:7], (100, 160, 400)), ("children", real[7:], (160, 400, 1000))]
    lengths = sorted({n for *_, ns in tables for n in ns})
    print(f"{'profile':<9}{'series':<22}" + "".join(f"{f'N={n}':>25}" for n in lengths))
    for profile, rows, ns in tables:
        for name, make, what, key in rows:
            cells = []
            for n in lengths:
                if n not in ns:
                    cells.append("")
                    continue
                columns = np.column_stack([make(n, rng) for _ in range(args.trials)])
                off = offline(columns, config, key)
                on = "" if args.quick else f" / {online(columns, key):.1%}"
                cells.append(f"{what} {off:.1%}{on}")
            print(f"{profile:<9}{name:<22}" + "".join(f"{c:>25}" for c in cells), flush=True)
    print(f"(tables in {time.perf_counter() - elapsed:.0f} s)")
    for world in (8, 64):
        median, worst, full = online_cost(world, rng)
        print(f"online cost, world {world}: per collect median {median:.2f} ms, max {worst:.2f} ms; "
              f"all {len(LEAK_KEYS) * world} series at once {full:.0f} ms")
    t0 = time.perf_counter()
    columns = np.column_stack([base(1000, rng, "noisy") for _ in range(64)])
    trends(np.arange(1000), columns, RSS, range(64), config)
    print(f"offline cost: 64 ranks x 1000 steps judged in {(time.perf_counter() - t0) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
