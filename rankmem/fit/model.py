"""Fit ``rise = a + b*T (+ c*Q)`` robustly, with a prediction interval; T tokens, Q sum of squared lengths.

``rise`` is a window's peak above its baseline, ``T`` the tokens of the window's heaviest micro-batch and
``Q`` the sum of its squared sequence lengths: activations are linear in T, materialised attention adds
scores linear in Q. The method:

- **Robust line** by Huber's M-estimator (IRLS, MAD scale), so that a window where the allocator kept a
  previous micro-batch's blocks is down-weighted instead of bending the fit.
- **The quadratic term only where the data reject a line**: Q must vary apart from T
  (:attr:`FitConfig.q_spread`) and its t statistic pass :attr:`FitConfig.t_quadratic`; across ranks
  :func:`rankmem.fit.quadratic_across` decides it once. A line kept where Q varies carries the quadratic
  fit as its :attr:`Fit.rival`, whose interval it joins.
- **Prediction interval** ``yhat +- t(n - p) * sqrt(s^2 (1 + x0' (X'WX)^-1 x0) + (r * yhat)^2)``, ``s``
  the robust scale (at least :attr:`FitConfig.noise_floor`), ``r`` the run-to-run noise
  (:attr:`FitConfig.relative_noise`).
- **Verdicts instead of fits** (:class:`NoFit`): too few windows, flat T, or a slope within its noise.

At a T never seen, Q is predicted as T times the mean Q/T seen, its spread (:meth:`Fit.sq_sd_at`) added
to the interval in quadrature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

HUBER_K = 1.345
MAD_TO_SD = 1.4826


@dataclass(frozen=True)
class FitConfig:
    """What a fit needs from the windows, and its thresholds."""

    min_windows: int = 6
    """Fewer windows (after warm-up) give no fit."""
    min_spread: float = 1.15
    """The largest T must be at least this multiple of the smallest, or the slope is not identifiable."""
    t_slope: float = 3.0
    """The rise per token must be this many standard errors above 0, or the series is noise."""
    t_quadratic: float = 3.0
    """The Q term's t statistic needed to keep it."""
    q_spread: float = 0.05
    """Q/T must spread by this fraction (max/min - 1) for the Q term to be separable from T."""
    level: float = 0.95
    """Two-sided coverage of the prediction interval."""
    noise_floor: float = 1.0 / 1024
    """Least residual scale, in the response's unit (GiB): 1 MiB."""
    relative_noise: float = 0.02
    """Run-to-run noise as a share of the predicted rise, added to the interval in quadrature: the windows
    of one run sit closer to their line than later steps do."""
    pool_ranks: bool = True
    """Fit a phase's rise per token and per squared length on every rank's windows at once, an intercept
    per rank (:func:`rankmem.fit.pooled.fit_phase`), where the ranks' own coefficients agree."""
    homogeneity: float = 0.99
    """The ranks' coefficients are pooled unless a Wald test says they differ at this level."""


@dataclass(frozen=True)
class NoFit:
    """Why no model: ``few``, ``flat`` or ``noisy``, and one line saying so with what to do."""

    kind: str
    reason: str


@dataclass(frozen=True)
class Fit:
    """``rise = a + b*T + c*Q`` (c = 0 for a line) with what its interval needs."""

    a: float
    b: float
    c: float
    quadratic: bool
    scale: float
    """Robust residual standard deviation, in the response's unit."""
    xtwx_inv: np.ndarray
    dof: int
    n: int
    t_max: float
    """The largest T seen (by any rank whose slope is pooled with this one): the advice extrapolates to at
    most 1.5 times this."""
    q_per_token: float
    """The largest Q/T seen (the longest token-weighted sequence length)."""
    level: float
    relative_noise: float = 0.0
    q_mean: float = 0.0
    """The mean Q/T seen."""
    q_sd: float = 0.0
    """The standard deviation of ``(Q/T - q_mean) * sqrt(T)`` over the windows: how far the heaviest
    micro-batch's Q/T strays from its mean, in units that do not shrink as a micro-batch holds more
    sequences (see :meth:`sq_at`)."""
    q_mean_se: float = 0.0
    """The standard error of :attr:`q_mean`: ``q_sd * sqrt(mean(1/T) / n)``."""
    rival: Fit | None = None
    """The quadratic fit a line was kept over, where Q varies apart from T but the test could not tell
    the two apart: its interval is joined to the line's (:meth:`predict`)."""

    def predict(self, tokens: float, sq_tokens: float | None = None) -> tuple[float, float, float]:
        """(rise, low, high) at ``tokens`` (and ``sq_tokens``, else :meth:`sq_at` with its spread). With a
        :attr:`rival`, the interval spans both models': where Q moved with T in the windows seen, a line
        that leaves it out is off at another Q/T by more than its own interval says."""
        q = sq_tokens if sq_tokens is not None else self.sq_at(tokens)
        x0 = np.array([1.0, tokens, q] if self.quadratic else [1.0, tokens])
        mean = self.a + self.b * tokens + self.c * q
        model_var = self.scale**2 * (1.0 + float(x0 @ self.xtwx_inv @ x0))
        if sq_tokens is None:  # a micro-batch not seen: its Q is as uncertain as the windows' Q/T was
            model_var += (self.c * self.sq_sd_at(tokens))**2
        noise = self.relative_noise * max(mean, 0.0)
        half = t_quantile(0.5 + self.level / 2, self.dof) * math.sqrt(model_var + noise**2)
        if self.rival is None:
            return mean, mean - half, mean + half
        _, low, high = self.rival.predict(tokens, sq_tokens)
        return mean, min(mean - half, low), max(mean + half, high)

    def sq_at(self, tokens: float) -> float:
        """Q expected of a heaviest micro-batch of ``tokens`` never seen: the mean Q/T seen times T. Its
        spread (:meth:`sq_sd_at`) goes into the prediction interval."""
        return self.q_mean * tokens

    def sq_sd_at(self, tokens: float) -> float:
        """The standard deviation of that Q. A micro-batch's Q/T is its token-weighted mean sequence
        length: over n sequences its spread shrinks as 1/sqrt(n), so as 1/sqrt(T), and Q's grows as
        sqrt(T)."""
        t = max(tokens, 0.0)
        return math.sqrt(self.q_sd**2 * t + (self.q_mean_se * t)**2)  # the next draw's, and the mean's

    def per_token(self) -> float:
        """The rise per token at the mean Q/T seen: the slope the imbalance split uses."""
        return self.b + self.c * self.q_mean


def usable_windows(tokens: np.ndarray, rise: np.ndarray, sq_tokens: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """(T, rise, Q) of the windows with finite T > 0 and rise; Q all nan where not told."""
    t = np.asarray(tokens, dtype=np.float64)
    y = np.asarray(rise, dtype=np.float64)
    q = np.asarray(sq_tokens, dtype=np.float64) if sq_tokens is not None else np.full_like(t, np.nan)
    ok = np.isfinite(t) & np.isfinite(y) & (t > 0)
    return t[ok], y[ok], q[ok]


def q_separable(t: np.ndarray, q: np.ndarray, cfg: FitConfig) -> bool:
    ratio = q / t
    return bool(q.size and np.isfinite(q).all() and ratio.max() > (1 + cfg.q_spread) * ratio.min())


def fit_memory(tokens: np.ndarray, rise: np.ndarray, sq_tokens: np.ndarray | None = None,
               config: FitConfig | None = None, quadratic: bool | None = None) -> Fit | NoFit:
    """Fit one phase of one rank; windows with a non-finite value are left out. ``quadratic``: the Q
    term as :func:`rankmem.fit.quadratic_across` decided it for the phase (kept where this rank's coefficient is
    positive), or None to test this rank's windows alone."""
    cfg = config or FitConfig()
    t, y, q = usable_windows(tokens, rise, sq_tokens)
    if t.size < cfg.min_windows:
        return NoFit("few", f"{t.size} window(s) with tokens after warm-up, the fit needs {cfg.min_windows}: "
                            f"run more steps")
    if t.max() < cfg.min_spread * t.min():
        return NoFit("flat", f"the heaviest micro-batch's tokens barely vary ({t.min():.0f}..{t.max():.0f}): vary "
                             f"the token budget over a few steps, or run longer on varied data")
    use_q = q_separable(t, q, cfg)
    spread = q_spread(t, q)
    line = huber_fit(np.column_stack([np.ones_like(t), t]), y, cfg)
    rival: Fit | None = None
    chosen, kept = line, False
    if use_q and t.size >= cfg.min_windows + 1:
        quad = huber_fit(np.column_stack([np.ones_like(t), t, q]), y, cfg)
        se_c = quad.scale * math.sqrt(max(quad.xtwx_inv[2, 2], 0.0))
        tested = quadratic if quadratic is not None else bool(se_c > 0 and quad.beta[2] / se_c > cfg.t_quadratic)
        if quad.beta[2] > 0 and se_c > 0 and tested:
            chosen, kept = quad, True
        elif quad.beta[2] > 0:
            rival = _fit_of(quad, True, t, spread, cfg)
    fit = _fit_of(chosen, kept, t, spread, cfg, rival)
    return check_slope(fit, cfg)


def q_spread(t: np.ndarray, q: np.ndarray) -> tuple[float, float, float, float]:
    """(largest, mean, scaled standard deviation, the mean's standard error) of Q/T, as :class:`Fit`
    keeps them; zeros where Q was not told."""
    if not (q.size > 1 and np.isfinite(q).all()):
        return 0.0, 0.0, 0.0, 0.0
    ratio = q / t
    mean = float(ratio.mean())
    sd = float(((ratio - mean) * np.sqrt(t)).std(ddof=1))
    return float(ratio.max()), mean, sd, sd * math.sqrt(float(np.mean(1.0 / t)) / t.size)


def _fit_of(solved: _Solved, quadratic: bool, t: np.ndarray, q: tuple[float, float, float, float], cfg: FitConfig,
            rival: Fit | None = None) -> Fit:
    beta = solved.beta
    return Fit(a=float(beta[0]), b=float(beta[1]), c=float(beta[2]) if quadratic else 0.0, quadratic=quadratic,
               scale=solved.scale, xtwx_inv=solved.xtwx_inv, dof=t.size - beta.size, n=int(t.size),
               t_max=float(t.max()), q_per_token=q[0], level=cfg.level, relative_noise=cfg.relative_noise,
               q_mean=q[1], q_sd=q[2], q_mean_se=q[3], rival=rival)


def check_slope(fit: Fit, cfg: FitConfig) -> Fit | NoFit:
    """The rise per token, ``b + c*Q/T``, must stand above its standard error."""
    g = np.array([0.0, 1.0, fit.q_mean] if fit.quadratic else [0.0, 1.0])
    se = fit.scale * math.sqrt(max(float(g @ fit.xtwx_inv @ g), 0.0))
    slope = fit.per_token()
    if not slope > cfg.t_slope * se:
        return NoFit("noisy", f"the peak does not follow the tokens above its noise (rise per token "
                              f"{slope * 2**30 / 1024:.2f} KiB, {slope / se if se > 0 else 0:.1f} standard errors; "
                              f"noise {fit.scale * 1024:.1f} MiB): nothing to size by tokens here")
    return fit


@dataclass(frozen=True)
class _Solved:
    beta: np.ndarray
    scale: float
    xtwx_inv: np.ndarray


def huber_fit(x: np.ndarray, y: np.ndarray, cfg: FitConfig, rounds: int = 50) -> _Solved:
    """Huber M-estimate by IRLS; columns scaled to unit size first (T is ~1e3, Q ~1e6: conditioning)."""
    norm = np.abs(x).max(axis=0)
    norm[norm == 0] = 1.0
    xs = x / norm
    w = np.ones_like(y)
    beta = np.linalg.lstsq(xs, y, rcond=None)[0]
    for _ in range(rounds):
        r = y - xs @ beta
        s = max(MAD_TO_SD * float(np.median(np.abs(r - np.median(r)))), 1e-12)
        w = np.minimum(1.0, HUBER_K / np.maximum(np.abs(r) / s, 1e-12))
        sw = np.sqrt(w)
        new = np.linalg.lstsq(xs * sw[:, None], y * sw, rcond=None)[0]
        if np.allclose(new, beta, rtol=1e-10, atol=1e-14):
            beta = new
            break
        beta = new
    r = y - xs @ beta
    n, p = xs.shape
    mad = MAD_TO_SD * float(np.median(np.abs(r - np.median(r))))
    rms = math.sqrt(float(np.sum(w * r * r)) / max(float(w.sum()) - p, 1.0))
    # MAD alone is optimistic on a dozen windows; the weighted RMS sees the tails the weights trimmed.
    scale = max(mad * math.sqrt(n / max(n - p, 1)), rms, cfg.noise_floor)
    inv_s = np.linalg.pinv((xs * w[:, None]).T @ xs)
    inv = inv_s / np.outer(norm, norm)
    return _Solved(beta / norm, scale, inv)


def t_quantile(p: float, dof: int) -> float:
    """Student's t quantile by the Cornish-Fisher expansion about the normal (within 1% for dof >= 3)."""
    z = normal_quantile(p)
    if dof <= 0:
        return math.inf
    d = float(dof)
    return (z + (z**3 + z) / (4 * d) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * d**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * d**3))


def normal_quantile(p: float) -> float:
    """Acklam's rational approximation of the standard normal quantile (relative error < 1.2e-9)."""
    a = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02, 1.383577518672690e02,
         -3.066479806614716e01, 2.506628277459239e00)
    b = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02, 6.680131188771972e01,
         -1.328068155288572e01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00, -2.549732539343734e00,
         4.374664141464968e00, 2.938163982698783e00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)
    low = 0.02425
    if p < low:
        u = math.sqrt(-2 * math.log(p))
        return (((((c[0] * u + c[1]) * u + c[2]) * u + c[3]) * u + c[4]) * u + c[5]) / \
            ((((d[0] * u + d[1]) * u + d[2]) * u + d[3]) * u + 1)
    if p > 1 - low:
        return -normal_quantile(1 - p)
    u = p - 0.5
    r = u * u
    return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * u / \
        (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)
