"""Periodicity of a curve over groups: the share of its variance that repeats with a period, its chance level, the
F-test p-value of a period and the dominant period; pure functions on numpy arrays."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np


def periodicity_score(curve: np.ndarray, period: int) -> Optional[float]:
    """Share of the curve's variance that repeats with ``period``: the variance of the period-folded means over
    the total variance (``R^2`` of a model with one level per ``index mod period``).

    When ``period`` divides the length this is exactly the spectral power at frequency ``1/period`` and its
    harmonics over the power at all non-zero frequencies (Parseval). 1 = the curve repeats every ``period``
    points; for pure noise its expectation is ``(period - 1) / (n - 1)`` (``periodicity_chance``). ``None`` for
    a flat curve.
    """
    x = np.asarray(curve, dtype=np.float64).reshape(-1)
    if period < 1 or period > len(x):
        raise ValueError(f"period={period} must lie in [1, {len(x)}]")
    total = float(np.sum((x - x.mean()) ** 2))
    if total <= 1e-12 * max(1.0, float(np.sum(x * x))):
        return None
    folded = np.arange(len(x)) % period
    means = np.bincount(folded, weights=x) / np.bincount(folded)
    between = float(np.sum((means[folded] - x.mean()) ** 2))
    return between / total


def periodicity_chance(n: int, period: int) -> float:
    """Expected ``periodicity_score`` of a curve of ``n`` i.i.d. noise points."""
    return (period - 1) / (n - 1) if n > 1 else math.nan


def _beta_fraction(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 3e-14
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def regularized_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)``."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1 - x) / b


def f_survival(f: float, d1: int, d2: int) -> float:
    """``P(F > f)`` for an F distribution with ``(d1, d2)`` degrees of freedom."""
    if f <= 0:
        return 1.0
    if math.isinf(f):
        return 0.0
    return regularized_beta(d2 / 2, d1 / 2, d2 / (d2 + d1 * f))


def period_pvalue(curve: np.ndarray, period: int) -> float:
    """ANOVA F-test of "the curve repeats with ``period``" (one level per ``index mod period``) against a flat
    curve with i.i.d. noise. Needs ``period < len(curve)``."""
    n = len(curve)
    d1, d2 = period - 1, n - period
    if d1 < 1 or d2 < 1:
        raise ValueError(f"period={period} needs 2 <= period < {n}")
    r2 = periodicity_score(curve, period)
    if r2 is None:
        return 1.0
    if r2 >= 1 - 1e-12:
        return 0.0
    return f_survival((r2 / d1) / ((1 - r2) / d2), d1, d2)


@dataclass(frozen=True)
class DominantPeriod:
    """The period that best explains a curve: ``period`` (``None`` when no period is significant or the curve
    is flat), its Bonferroni-adjusted F-test ``p_value`` and its ``score`` (``periodicity_score``)."""

    period: Optional[int]
    p_value: Optional[float]
    score: Optional[float]


def dominant_period(curve: np.ndarray, alpha: float = 0.05) -> DominantPeriod:
    """Among periods ``2..n//2`` (at least two full repeats), the one whose period-folded model is most
    significant (ties: the shortest, so a period-4 curve is period 4, not 8 or 12); kept when its p-value,
    multiplied by the number of candidate periods, is below ``alpha``. Unlike the strongest Fourier
    component, this finds the period of a curve whose second harmonic dominates (e.g. 0.9, 0.6, 0.95, 0.2)."""
    x = np.asarray(curve, dtype=np.float64).reshape(-1)
    candidates = list(range(2, len(x) // 2 + 1))
    if not candidates or float(np.ptp(x)) <= 1e-12:
        return DominantPeriod(None, None, None)
    pvals = [period_pvalue(x, p) for p in candidates]
    best = int(np.argmin(pvals))
    adjusted = min(1.0, pvals[best] * len(candidates))
    period = candidates[best]
    return DominantPeriod(period if adjusted < alpha else None, adjusted, periodicity_score(x, period))
