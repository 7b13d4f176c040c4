"""One phase's fit across its ranks: the rise per token and per squared length shared, an intercept per rank.

``b`` and ``c`` are the model's, the same on every rank running the same model on its own data; ``a`` is
not (an engine, a leak on one rank moves only its intercept). Fitted on every rank's windows at once,
the shared coefficients rest on all of them.

- **Pooled only where the ranks agree**: a Wald test that the ranks' own ``(b, c)`` are one
  (:func:`_agree`, at :attr:`FitConfig.homogeneity`); ranks that differ (pipeline stages, other work) or
  have no fit of their own keep their own.
- **The fit**: Huber IRLS as :func:`rankmem.fit.fit_memory`, each rank weighted by its own residual
  scale, the per-rank intercepts taken out by weighted centring within the rank.
- **Each rank's interval** is the usual one in its own ``[1, T, Q]``, with its own residual scale and
  degrees of freedom. A rank whose pooled fit fails the slope check keeps its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rankmem.fit.model import (
    HUBER_K,
    MAD_TO_SD,
    Fit,
    FitConfig,
    NoFit,
    check_slope,
    fit_memory,
    huber_fit,
    normal_quantile,
    q_separable,
    q_spread,
    usable_windows,
)

Group = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]
"""One rank's windows: (T, rise, Q or None)."""


@dataclass(frozen=True)
class _Pooled:
    beta: np.ndarray
    """The shared coefficients (per token, per squared length)."""
    intercepts: list[float]
    scale: float
    """Robust residual scale over every rank's windows, each rank's residuals in units of its own scale
    where those were given (then ~1), else in the response's unit."""
    cov: np.ndarray
    """``(X'WX)^-1`` of the shared columns about each rank's weighted means, in their own units, W holding
    each window's Huber weight over its rank's squared scale: ``Var(beta) = scale^2 cov``."""
    means: list[np.ndarray]
    """Each rank's weighted means of the shared columns."""
    weights: list[float]
    """Each rank's sum of final weights over its squared scale (the intercept's ``1/W_k``)."""
    residuals: list[np.ndarray]
    huber: list[np.ndarray]
    """Each rank's windows' final Huber weights."""


def _mad(r: np.ndarray) -> float:
    return MAD_TO_SD * float(np.median(np.abs(r - np.median(r))))


def _pooled_huber(xs: Sequence[np.ndarray], ys: Sequence[np.ndarray], cfg: FitConfig,
                  scales: Sequence[float] | None = None, rounds: int = 50) -> _Pooled:
    """Huber M-estimate of ``y = a_k + x beta`` over groups k, by IRLS with weighted centring per group.
    ``scales``: each group's own residual scale: its windows weigh ``1/s_k^2`` and its residuals are
    judged in units of ``s_k`` (a quiet rank is not swamped by a noisy one; None: one scale for all)."""
    sk = np.ones(len(ys)) if scales is None else np.asarray(scales, dtype=np.float64)
    norm = np.abs(np.concatenate(xs)).max(axis=0)
    norm[norm == 0] = 1.0
    xs = [x / norm for x in xs]
    w = [np.ones_like(y) for y in ys]
    beta = None
    for _ in range(rounds):
        means = [(wk[:, None] * x).sum(axis=0) / wk.sum() for x, wk in zip(xs, w, strict=True)]
        xc = np.concatenate([x - m for x, m in zip(xs, means, strict=True)])
        yc = np.concatenate([y - float(wk @ y) / wk.sum() for y, wk in zip(ys, w, strict=True)])
        sw = np.sqrt(np.concatenate([wk / s**2 for wk, s in zip(w, sk, strict=True)]))
        new = np.linalg.lstsq(xc * sw[:, None], yc * sw, rcond=None)[0]
        intercepts = [float(wk @ y) / wk.sum() - float(m @ new) for y, wk, m in zip(ys, w, means, strict=True)]
        res = [y - a - x @ new for x, y, a in zip(xs, ys, intercepts, strict=True)]
        z = [r / s for r, s in zip(res, sk, strict=True)]
        s_z = max(_mad(np.concatenate(z)), 1e-12)
        w = [np.minimum(1.0, HUBER_K / np.maximum(np.abs(zk) / s_z, 1e-12)) for zk in z]
        done = beta is not None and np.allclose(new, beta, rtol=1e-10, atol=1e-14)
        beta = new
        if done:
            break
    assert beta is not None
    means = [(wk[:, None] * x).sum(axis=0) / wk.sum() for x, wk in zip(xs, w, strict=True)]
    intercepts = [float(wk @ y) / wk.sum() - float(m @ beta) for y, wk, m in zip(ys, w, means, strict=True)]
    res = [y - a - x @ beta for x, y, a in zip(xs, ys, intercepts, strict=True)]
    zall = np.concatenate([r / s for r, s in zip(res, sk, strict=True)])
    wall = np.concatenate(w)
    lw = np.concatenate([wk / s**2 for wk, s in zip(w, sk, strict=True)])
    n, p, k = zall.size, beta.size, len(ys)
    dof = max(n - p - k, 1)
    rms = math.sqrt(float(np.sum(wall * zall * zall)) / max(float(wall.sum()) - p - k, 1.0))
    scale = max(_mad(zall) * math.sqrt(n / dof), rms, cfg.noise_floor if scales is None else 0.0)
    xc = np.concatenate([x - m for x, m in zip(xs, means, strict=True)])
    cov = np.linalg.pinv((xc * lw[:, None]).T @ xc) / np.outer(norm, norm)
    return _Pooled(beta / norm, intercepts, scale, cov, [m * norm for m in means],
                   [float(wk.sum()) / s**2 for wk, s in zip(w, sk, strict=True)], res, w)


def quadratic_across(groups: Sequence[Group], config: FitConfig | None = None) -> bool | None:
    """Whether one phase's windows on several ranks (``(T, rise, Q)`` per rank) reject a line: one robust
    fit of ``rise = a_rank + b*T + c*Q`` over all of them, Q kept where it varies apart from T and its
    coefficient's t statistic is above :attr:`FitConfig.t_quadratic`. None where fewer than two ranks
    have windows enough, each with Q (each rank then tests its own). A rank's dozen windows alone rarely
    show ``c`` above its noise though it is there.
    """
    cfg = config or FitConfig()
    kept = [g for g in (usable_windows(*group) for group in groups)
            if g[0].size >= cfg.min_windows and np.isfinite(g[2]).all()]
    if len(kept) < 2:
        return None
    if not q_separable(np.concatenate([g[0] for g in kept]), np.concatenate([g[2] for g in kept]), cfg):
        return False
    solved = _pooled_huber([np.column_stack([t, q]) for t, _, q in kept], [y for _, y, _ in kept], cfg)
    se_c = solved.scale * math.sqrt(max(float(solved.cov[1, 1]), 0.0))
    return bool(solved.beta[1] > 0 and se_c > 0 and solved.beta[1] / se_c > cfg.t_quadratic)


def fit_phase(groups: Sequence[Group], config: FitConfig | None = None) -> list[Fit | NoFit]:
    """Every rank's fit of one phase (``(T, rise, Q or None)`` per rank, in rank order): the Q term decided
    once on all ranks' windows (:func:`quadratic_across`), then the shared coefficients fitted on every
    rank whose own fit agrees with the others' (see the module's docstring); the rest keep their own."""
    cfg = config or FitConfig()
    quadratic = quadratic_across(groups, cfg)
    fits: list[Fit | NoFit] = [fit_memory(*g, config=cfg, quadratic=quadratic) for g in groups]
    if not cfg.pool_ranks:
        return fits
    quad = quadratic is True
    usable = [usable_windows(*g) for g in groups]
    # Where no test across ranks was made (fewer than two ranks told Q throughout), a rank whose own fit
    # kept the Q term is not pooled into a line.
    members = [k for k, f in enumerate(fits) if isinstance(f, Fit) and
               (np.isfinite(usable[k][2]).all() if quad else not (quadratic is None and f.quadratic))]
    if len(members) < 2:
        return fits
    data = [usable[k] for k in members]
    scales = [fits[k].scale for k in members]  # type: ignore[union-attr]
    columns = [np.column_stack([t, q] if quad else [t]) for t, _, q in data]
    if not _agree(columns, [y for _, y, _ in data], cfg):
        return fits
    pooled = _pooled_huber(columns, [y for _, y, _ in data], cfg, scales)
    if not (pooled.beta > 0).all():
        return fits
    rivals: list[Fit | None] = [None] * len(members)
    if not quad and all(np.isfinite(q).all() for _, _, q in data) and \
            q_separable(np.concatenate([d[0] for d in data]), np.concatenate([d[2] for d in data]), cfg):
        both = _pooled_huber([np.column_stack([t, q]) for t, _, q in data], [y for _, y, _ in data], cfg, scales)
        if both.beta[1] > 0:
            rivals = [_rank_fit(both, i, True, data[i], cfg) for i in range(len(members))]
    # The shared slope was seen up to the largest T of any member: that bounds how far it extrapolates.
    seen = max(float(t.max()) for t, _, _ in data)
    for i, k in enumerate(members):
        shared = check_slope(_rank_fit(pooled, i, quad, data[i], cfg, rivals[i], seen), cfg)
        if isinstance(shared, Fit):  # else the rank keeps its own fit, which passed that check
            fits[k] = shared
    return fits


def _rank_fit(pooled: _Pooled, i: int, quadratic: bool, data: tuple[np.ndarray, ...], cfg: FitConfig,
              rival: Fit | None = None, t_seen: float = 0.0) -> Fit:
    """Rank ``i``'s Fit from the pooled one: its intercept, the shared coefficients, the covariance of
    ``(a_i, b, c)`` in its own ``[1, T, Q]`` (``Var a_i = 1/W_i + m' V m``, ``Cov(a_i, beta) = -V m``)."""
    t, _, q = data
    m, v = pooled.means[i], pooled.cov
    r, hw = pooled.residuals[i], pooled.huber[i]
    n = r.size
    # The rank's own scale about the shared line (a noisier rank keeps a wider interval), robust as
    # :func:`rankmem.fit.huber_fit`'s: the MAD, or the Huber-weighted RMS (the tails the weights trimmed,
    # not the outliers they down-weighted); its intercept is its one parameter of its own, with its share
    # of the shared ones, and its degrees of freedom are the t quantile's.
    dof = max(round(n - 1 - pooled.beta.size / len(pooled.weights)), 1)
    rms = math.sqrt(float(np.sum(hw * r * r)) / max(float(hw.sum()) - 1.0, 1.0)) if n > 1 else 0.0
    own = max(_mad(r) * math.sqrt(n / max(n - 1, 1)), rms, cfg.noise_floor)
    # Cov(a_i, beta) = scale^2 [[1/W_i + m'Vm, -Vm], [-Vm, V]] (V: pooled.cov); Fit.predict multiplies its
    # xtwx_inv by the rank's own scale squared, so it carries the ratio of the two.
    inv = np.empty((v.shape[0] + 1,) * 2)
    inv[0, 0] = 1.0 / pooled.weights[i] + float(m @ v @ m)
    inv[0, 1:] = inv[1:, 0] = -(v @ m)
    inv[1:, 1:] = v
    inv *= (pooled.scale / own)**2
    spread = q_spread(t, q)
    return Fit(a=pooled.intercepts[i], b=float(pooled.beta[0]), c=float(pooled.beta[1]) if quadratic else 0.0,
              quadratic=quadratic, scale=own, xtwx_inv=inv, dof=dof, n=int(t.size),
              t_max=max(float(t.max()), t_seen),
              q_per_token=spread[0], level=cfg.level, relative_noise=cfg.relative_noise, q_mean=spread[1],
               q_sd=spread[2], q_mean_se=spread[3], rival=rival)


def _agree(columns: Sequence[np.ndarray], ys: Sequence[np.ndarray], cfg: FitConfig) -> bool:
    """Whether the ranks' own coefficients are one: the Wald statistic of each rank's own fit about their
    precision-weighted mean, at :attr:`FitConfig.homogeneity`.

    Each rank's covariance is estimated from its own windows, so each term is a ``p F(p, nu)`` rather than a
    chi-square, whose heavier tail a plain chi-square test would read as disagreement: the sum is matched
    to a scaled chi-square by its mean and variance (Satterthwaite), nu the ranks' median degrees of freedom.
    """
    betas, precisions, dofs = [], [], []
    for x, y in zip(columns, ys, strict=True):
        solved = huber_fit(np.column_stack([np.ones(y.size), x]), y, cfg)
        cov = solved.scale**2 * solved.xtwx_inv[1:, 1:]
        betas.append(solved.beta[1:])
        precisions.append(np.linalg.pinv(cov))
        dofs.append(y.size - 1 - x.shape[1])
    mean = np.linalg.pinv(sum(precisions)) @ sum(p @ b for p, b in zip(precisions, betas, strict=True))
    stat = sum(float((b - mean) @ p @ (b - mean)) for p, b in zip(precisions, betas, strict=True))
    p, k = columns[0].shape[1], len(columns)
    nu = max(float(np.median(dofs)), 4.5)  # the F's variance needs nu > 4
    mean_f = nu / (nu - 2)
    var_f = 2 * nu * nu * (p + nu - 2) / (p * (nu - 2)**2 * (nu - 4))
    mean_stat, var_stat = p * (k - 1) * mean_f, (k - 1) * p * p * var_f
    g, h = var_stat / (2 * mean_stat), 2 * mean_stat**2 / var_stat
    return bool(stat / g <= chi2_quantile(cfg.homogeneity, max(round(h), 1)))


def chi2_quantile(p: float, dof: int) -> float:
    """Chi-square quantile by Wilson and Hilferty's cube-root normal approximation (within 1% from dof 3
    at the upper quantiles used here)."""
    z = normal_quantile(p)
    k = float(max(dof, 1))
    return k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k)))**3


def prime() -> None:
    """Fit made-up windows once, each kind a judge makes (a line with its quadratic rival, the pooled Q
    test and the pooled fit): a process's first fit leaves ~2 MiB resident for good (numpy's code pages
    and workspaces). The publisher calls this on every rank when the monitor is made, so that the rank's
    baseline does not step up in the middle of the windows at the online watches' first judgements."""
    t = np.arange(8.0, 16.0)
    q = t * t * (1.0 + 0.1 * (t % 3))
    rise = 1e-3 * (t + 1e-3 * q) + 1e-6 * (t % 2)
    fit_phase([(t, rise, q), (t, rise + 1e-3 + 1e-6 * (t % 3), q)])
    fit_memory(t, rise, q)


