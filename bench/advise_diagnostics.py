"""Where the advice's error comes from, read back from bench/bench_advise.py's stored run logs (no run).

Run:  python bench/advise_diagnostics.py DIR materialized     (DIR: the --out of an earlier bench_advise run)

Prints, over every seed in DIR of that attention path:

1. the shape the model misses: one line ``a + b*T + c*Q`` per rank fitted by least squares to all its
   windows (probe and held out), and the mean residual by T: a curve the model cannot follow shows as
   residuals that change sign along T;
2. how well the windows pin the Q term: the spread of the fitted ``c`` over seeds (the model is the same
   on every seed, so its true ``c`` is one number), its correlation with ``b``, and with the held-out bias;
3. the interval's run-to-run term: held-out coverage and the advice at a few
   :attr:`rankmem.fit.FitConfig.relative_noise` values, and with each rank's coefficients fitted alone
   (:attr:`rankmem.fit.FitConfig.pool_ranks` off);
4. what the resident memory between steps is made of, step by step (where the run logs carry the
   bench's ``bench/rss_*`` split): anonymous and file pages over the first probe window's, mean over seeds;
5. what holds the advice under the bisected budget: per rank fit, the held-out bias (the mean of true
   minus predicted rise over its held-out windows, each at its own T and Q: the fit's own error where it
   extrapolates) and the interval's half-width at the advised T, and per seed how the advice's ratio to
   the bisected budget follows the worse of its ranks' biases; the lowest seeds in full.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_advise import evaluate  # type: ignore[import-not-found]  # noqa: E402

from rankmem.core.catalogue import phase_key, work_key  # noqa: E402
from rankmem.fit.capacity import Limit  # noqa: E402
from rankmem.fit.model import Fit, FitConfig  # noqa: E402
from rankmem.fit.series import PhaseFit  # noqa: E402
from rankmem.offline import Run, read_run  # noqa: E402
from rankmem.offline.advice import EXTRAPOLATION, Advice, advise_rank, fit_ranks  # noqa: E402

WARMUP = 2  # bench_advise's warm-up steps at the start of the probe


def windows(run: Run, rank: int, first: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(T, Q, peak) of one rank's update windows from row ``first`` on."""
    return tuple(np.asarray(run.series[key][first:, rank], dtype=np.float64)  # type: ignore[return-value]
                 for key in (work_key("update", "mb_tokens"), work_key("update", "mb_sq_tokens"),
                             phase_key("update", "peak_rss_gib")))


def held_out(held: Run, rank: int, pf: PhaseFit) -> tuple[np.ndarray, np.ndarray]:
    """(true rise, predicted rise) of one rank's held-out windows the model is trusted at (up to
    EXTRAPOLATION x the largest T it saw), each predicted at its own T and Q."""
    assert isinstance(pf.model, Fit)
    t, q, y = windows(held, rank, 0)
    keep = t <= EXTRAPOLATION * pf.model.t_max
    pred = np.array([pf.model.predict(a, b)[0] for a, b in zip(t[keep], q[keep], strict=True)])
    return y[keep] - pf.baseline, pred


def shape(seeds: list[tuple[Run, Run]]) -> None:
    residuals = []
    for probe, held in seeds:
        for rank in range(probe.world_size):
            t, q, y = (np.r_[a, b] for a, b in zip(windows(probe, rank, WARMUP), windows(held, rank, 0), strict=True))
            x = np.column_stack([np.ones_like(t), t, q])
            beta = np.linalg.lstsq(x, y, rcond=None)[0]
            residuals += list(zip(t, (y - x @ beta) * 1024, strict=True))
    r = np.array(residuals)
    print("1. mean residual of one least-squares line a + b*T + c*Q per rank through all its windows, by T:")
    for lo in range(int(r[:, 0].min()) // 200 * 200, int(r[:, 0].max()) + 1, 200):
        m = (r[:, 0] >= lo) & (r[:, 0] < lo + 200)
        if m.any():
            print(f"   T {lo}-{lo + 199}: {int(m.sum())} windows, {r[m, 1].mean():+.2f} MiB")


def q_term(seeds: list[tuple[Run, Run]]) -> None:
    rows = []
    for probe, held in seeds:
        for rank, pf in enumerate(fit_ranks(probe, "update", warmup=WARMUP)):
            m = pf.model
            if not (isinstance(m, Fit) and m.quadratic):
                continue  # a line (SDPA) has no Q term to pin
            rise, pred = held_out(held, rank, pf)
            rows.append((m.c * 2**30, m.b * 2**20, float(np.mean((pred - rise) / rise)) * 100))
    if len(rows) < 2:
        print("2. no rank fit kept the Q term")
        return
    a = np.array(rows)
    print(f"2. c over {len(rows)} rank fits: {a[:, 0].mean():.0f} bytes per squared token, sd {a[:, 0].std():.0f}, "
          f"{a[:, 0].min():.0f}..{a[:, 0].max():.0f}; b {a[:, 1].mean():.1f} KiB per token, sd {a[:, 1].std():.1f}; "
          f"corr(b, c) {np.corrcoef(a[:, 0], a[:, 1])[0, 1]:+.2f}; corr(c, held-out bias) "
          f"{np.corrcoef(a[:, 0], a[:, 2])[0, 1]:+.2f}")


def noise_term(dirs: list[str]) -> None:
    print("3. the interval's run-to-run term, and each rank's coefficients fitted alone:")
    variants = [(f"relative_noise {noise:.4f}", FitConfig(relative_noise=noise)) for noise in (0.0, 0.0075, 0.015,
                                                                                               0.0225)]
    for label, config in variants + [("each rank alone", FitConfig(pool_ranks=False))]:
        rows = [evaluate(out, config) for out in dirs]
        errors = [e for r in rows for e in r["errors"]]
        outside = sum((1 - r["coverage"]) * r["windows"] for r in rows) / sum(r["windows"] for r in rows)
        ratios = [r["advised"] / r["bisected"] for r in rows]
        print(f"   {label}: worst error {max(errors):.2%}, held-out windows outside {outside:.1%}, seeds whose "
              "held-out peak fell "
              f"outside {sum(not r['peak_inside'] for r in rows)}/{len(rows)}, advised / bisected min "
              f"{min(ratios):.3f} "
              f"median {statistics.median(ratios):.3f}, over the bisected in {sum(r > 1 for r in ratios)}")


def resident_split(seeds: list[tuple[Run, Run]]) -> None:
    keys = ("bench/rss_anon_gib", "bench/rss_file_gib", "bench/anon_before_gib")
    if not all(k in probe.series for probe, _ in seeds for k in keys):
        print("4. no resident split in these run logs (bench_advise.py records it from this version on)")
        return
    print("4. between-step resident memory over the first probe window's, MiB, mean over seeds and ranks "
          "(anon: heap and mmap'd blocks; file: code and data faulted in; anon before: at the window's start):")
    rows = []  # per (seed, rank): the step-by-step series of the probe then the held-out run
    for probe, held in seeds:
        both = {k: np.r_[probe.series[k][WARMUP:], held.series[k]] for k in (*keys, "bench/budget")}
        for rank in range(probe.world_size):
            rows.append({k: np.asarray(v[:, rank], dtype=np.float64) for k, v in both.items()})
    n = min(r["bench/budget"].size for r in rows)
    marks = sorted({0, 1, n // 4, n // 2, n - 1} | {i for i in range(n) if i < 40 and i % 5 == 4})
    for i in (m for m in marks if m < n):
        anon = np.mean([(r["bench/rss_anon_gib"][i] - r["bench/rss_anon_gib"][0]) * 1024 for r in rows])
        file = np.mean([(r["bench/rss_file_gib"][i] - r["bench/rss_file_gib"][0]) * 1024 for r in rows])
        before = np.mean([(r["bench/anon_before_gib"][i] - r["bench/anon_before_gib"][0]) * 1024 for r in rows])
        budget = statistics.median(float(r["bench/budget"][i]) for r in rows)
        print(f"   window {i:2d} (budget {budget:.0f}): anon {anon:+6.2f}, file {file:+6.2f}, anon before "
              f"{before:+6.2f}")


def shortfall(dirs: list[str], seeds: list[tuple[Run, Run]]) -> None:
    print("5. what holds the advice down (bias: mean true - predicted rise over a rank's held-out windows, MiB; "
          "half: the interval's half-width at the advised T, MiB; Q: its Q-spread part):")
    per_seed = []  # (ratio, worst bias, text)
    biases, halves = [], []
    for out, (probe, held) in zip(dirs, seeds, strict=True):
        row = evaluate(out)
        with open(os.path.join(out, "bench.json")) as f:
            usable = float(json.load(f)["usable"])
        parts, worst = [], math.inf
        for rank, pf in enumerate(fit_ranks(probe, "update", warmup=WARMUP)):
            m = pf.model
            advice = advise_rank(pf, Limit(usable, "bench", 0.0))
            if not (isinstance(m, Fit) and isinstance(advice, Advice)):
                continue
            rise, pred = held_out(held, rank, pf)
            bias = float(np.mean(rise - pred)) * 1024
            mean, _, high = m.predict(float(advice.max_tokens))
            half = (high - mean) * 1024
            biases.append(bias)
            halves.append(half)
            worst = min(worst, bias)
            parts.append(f"rank {rank}: T {advice.max_tokens:.0f}, bias {bias:+.1f}, half {half:.1f} "
                         f"(Q {m.c * m.sq_sd_at(advice.max_tokens) * 1024:.1f}, scatter {m.scale * 1024:.1f}), "
                         f"c {m.c * 2**30:.0f} B")
        if parts:  # a seed none of whose ranks has a fit and advice has no bias to show
            per_seed.append((row["advised"] / row["bisected"], worst,
                             f"{os.path.basename(out)} (bisected {row['bisected']}): "
                             + "; ".join(parts)))
    if len(per_seed) < 3:
        print("   too few seeds")
        return
    b, h = np.array(biases), np.array(halves)
    ratio, worst_bias = np.array([r[0] for r in per_seed]), np.array([r[1] for r in per_seed])
    print(f"   bias over {b.size} rank fits: 5/25/50/75/95th percentiles "
          f"{' / '.join(f'{v:+.1f}' for v in np.percentile(b, [5, 25, 50, 75, 95]))} MiB; half-width median "
          f"{np.median(h):.1f} "
          f"({np.percentile(h, 5):.1f}..{np.percentile(h, 95):.1f}); corr(advised / bisected, the worse rank's bias) "
          f"{np.corrcoef(ratio, worst_bias)[0, 1]:+.2f}")
    for r, _, text in sorted(per_seed)[:5]:
        print(f"   {r:.3f} {text}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="an earlier `bench_advise.py --out` directory")
    p.add_argument("attention", choices=("sdpa", "materialized"))
    args = p.parse_args()
    prefix = f"{args.attention}-"
    dirs = sorted((os.path.join(args.out, d) for d in os.listdir(args.out)
                   if d.startswith(prefix) and os.path.exists(os.path.join(args.out, d, "bench.json"))),
                  key=lambda d: int(d.rsplit("-", 1)[1]))
    if not dirs:
        raise SystemExit(f"{args.out} holds no finished {args.attention} seed: run bench/bench_advise.py --out "
                         f"{args.out}")
    seeds = [(read_run(os.path.join(d, "probe")), read_run(os.path.join(d, "held"))) for d in dirs]
    print(f"{args.attention}: {len(dirs)} seeds from {args.out}")
    shape(seeds)
    q_term(seeds)
    noise_term(dirs)
    resident_split(seeds)
    shortfall(dirs, seeds)


if __name__ == "__main__":
    main()
