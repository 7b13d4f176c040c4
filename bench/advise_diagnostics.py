"""Where the advice's error comes from, read back from bench/bench_advise.py's stored run logs (no run).

Run:  python bench/advise_diagnostics.py DIR materialized     (DIR: the --out of an earlier bench_advise run)

Prints, over every seed in DIR of that attention path:

1. the shape the model misses: one line ``a + b*T + c*Q`` per rank fitted by least squares to all its
   windows (probe and held out), and the mean residual by T: a curve the model cannot follow shows as
   residuals that change sign along T;
2. how well the windows pin the Q term: the spread of the fitted ``c`` over seeds (the model is the same
   on every seed, so its true ``c`` is one number), its correlation with ``b``, and with the held-out bias;
3. the interval's run-to-run term: held-out coverage and the advice at a few
   :attr:`rankmem.fit.FitConfig.relative_noise` values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rankmem.core.catalogue import phase_key, work_key  # noqa: E402
from rankmem.fit import FitConfig  # noqa: E402
from rankmem.offline import Run, read_run  # noqa: E402
from rankmem.offline.advice import EXTRAPOLATION, Limit, advise_rank, fit_ranks  # noqa: E402

WARMUP = 2  # bench_advise's warm-up steps at the start of the probe


def windows(run: Run, rank: int, first: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(T, Q, peak) of one rank's update windows from row ``first`` on."""
    return tuple(np.asarray(run.series[key][first:, rank], dtype=np.float64)  # type: ignore[return-value]
                 for key in (work_key("update", "mb_tokens"), work_key("update", "mb_sq_tokens"),
                             phase_key("update", "peak_rss_gib")))


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
            if not getattr(m, "quadratic", False):
                continue  # a line (SDPA) has no Q term to pin
            t, q, y = windows(held, rank, 0)
            keep = t <= EXTRAPOLATION * m.t_max  # type: ignore[union-attr]
            rise = y[keep] - pf.baseline
            pred = np.array([m.predict(a, b)[0] for a, b in zip(t[keep], q[keep], strict=True)])  # type: ignore[union-attr]
            rows.append((m.c * 2**30, m.b * 2**20, float(np.mean((pred - rise) / rise)) * 100))  # type: ignore[union-attr]
    if len(rows) < 2:
        print("2. no rank fit kept the Q term")
        return
    a = np.array(rows)
    print(f"2. c over {len(rows)} rank fits: {a[:, 0].mean():.0f} bytes per squared token, sd {a[:, 0].std():.0f}, "
          f"{a[:, 0].min():.0f}..{a[:, 0].max():.0f}; b {a[:, 1].mean():.1f} KiB per token, sd {a[:, 1].std():.1f}; "
          f"corr(b, c) {np.corrcoef(a[:, 0], a[:, 1])[0, 1]:+.2f}; corr(c, held-out bias) {np.corrcoef(a[:, 0], a[:, 2])[0, 1]:+.2f}")


def noise_term(dirs: list[str], seeds: list[tuple[Run, Run]]) -> None:
    print("3. the interval's run-to-run term:")
    for noise in (0.0, 0.0075, 0.015, 0.0225):
        cfg = FitConfig(relative_noise=noise)
        ratios, inside, tops_out = [], [], 0
        for out, (probe, held) in zip(dirs, seeds, strict=True):
            with open(os.path.join(out, "bench.json")) as f:
                truth = json.load(f)
            budgets = probe.series["bench/budget"][WARMUP:]
            overshoot = max(1.0, float(np.nanmax(probe.series[work_key("update", "mb_tokens")][WARMUP:] / budgets)))
            advised, top_ok = [], True
            for rank, pf in enumerate(fit_ranks(probe, "update", warmup=WARMUP, config=cfg)):
                t, q, y = windows(held, rank, 0)
                trusted = np.nonzero(t <= EXTRAPOLATION * pf.model.t_max)[0]  # type: ignore[union-attr]
                for i in trusted:
                    _, low, high = pf.peak(float(t[i]), float(q[i]))
                    inside.append(low <= y[i] <= high)
                top = trusted[int(np.argmax(y[trusted]))]
                _, low, high = pf.peak(float(t[top]), float(q[top]))
                top_ok &= bool(low <= y[top] <= high)
                advice = advise_rank(pf, Limit(truth["usable"], "bench", 0.0))
                advised.append(advice.max_tokens if not isinstance(advice, str) else 0)
            tops_out += not top_ok
            ratios.append(min(advised) / overshoot / truth["bisected"])
        print(f"   relative_noise {noise:.4f}: held-out windows outside {1 - np.mean(inside):.1%}, seeds whose held-out "
              f"peak fell outside {tops_out}/{len(seeds)}, advised / bisected min {min(ratios):.3f} median "
              f"{statistics.median(ratios):.3f}, over the bisected in {sum(r > 1 for r in ratios)}")


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
        raise SystemExit(f"{args.out} holds no finished {args.attention} seed: run bench/bench_advise.py --out {args.out}")
    seeds = [(read_run(os.path.join(d, "probe")), read_run(os.path.join(d, "held"))) for d in dirs]
    print(f"{args.attention}: {len(dirs)} seeds from {args.out}")
    shape(seeds)
    q_term(seeds)
    noise_term(dirs, seeds)


if __name__ == "__main__":
    main()
