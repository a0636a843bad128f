"""Statistics of phase-grouped accuracy: pure functions on numpy arrays, no model, no I/O.

Conventions: ``correct`` (n,) is 0/1 per scored target; ``groups`` (n,) its group in ``0..n_groups-1`` (a residue
``position mod M`` or a phase ``position mod S``); ``clusters`` (n,) says which samples share a key->value mapping
(in the paired design, every shifted copy of one base example). Accuracies are fractions in [0, 1]; a group
with no samples has accuracy NaN. Randomised statistics take an explicit ``seed`` and are deterministic.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

Z95 = 1.959963984540054  # two-sided 95% standard-normal quantile
Z_ONE_SIDED_95 = 1.6448536269514722  # one-sided 95% standard-normal quantile
WILSON = "wilson"  # interval kinds, named in every output that carries an interval
CLUSTER_BOOTSTRAP = "cluster_bootstrap"
BOOTSTRAP = "bootstrap"  # over single samples (no clusters given)
_CHUNK_ELEMENTS = 4_000_000  # bounds the memory of vectorised resampling (replicates x samples)


# ---- intervals and group accuracy ------------------------------------------------------------------------------
def wilson_interval(successes: np.ndarray | int, n: np.ndarray | int, z: float = Z95) -> tuple[np.ndarray, np.ndarray]:
    """Wilson score interval of a binomial proportion (vectorised). ``n == 0`` gives ``[0, 1]``."""
    k = np.asarray(successes, dtype=np.float64)
    m = np.asarray(n, dtype=np.float64)
    safe = np.maximum(m, 1.0)
    p = k / safe
    denom = 1.0 + z * z / safe
    centre = (p + z * z / (2 * safe)) / denom
    half = z * np.sqrt(p * (1 - p) / safe + z * z / (4 * safe * safe)) / denom
    lo = np.where((m > 0) & (k > 0), np.clip(centre - half, 0.0, 1.0), 0.0)  # exact ends at 0/n and n/n
    hi = np.where((m > 0) & (k < m), np.clip(centre + half, 0.0, 1.0), 1.0)
    return lo, hi


@dataclass(frozen=True)
class GroupAccuracy:
    """Per-group accuracy with 95% intervals; arrays of shape (n_groups,). ``interval`` names their kind:
    ``wilson`` (prompts independent) or ``cluster_bootstrap`` (see ``with_cluster_intervals``)."""

    n: np.ndarray
    correct: np.ndarray
    accuracy: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    interval: str = WILSON

    @property
    def n_groups(self) -> int:
        return len(self.n)


def _check_inputs(correct: np.ndarray, groups: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    c = np.asarray(correct, dtype=np.float64).reshape(-1)
    g = np.asarray(groups, dtype=np.int64).reshape(-1)
    if c.shape != g.shape:
        raise ValueError(f"correct {c.shape} and groups {g.shape} must have the same length")
    if n_groups < 1:
        raise ValueError(f"n_groups={n_groups} must be >= 1")
    if len(g) and (g.min() < 0 or g.max() >= n_groups):
        raise ValueError(f"groups must lie in [0, {n_groups}); got [{g.min()}, {g.max()}]")
    return c, g


def group_accuracy(correct: np.ndarray, groups: np.ndarray, n_groups: int, z: float = Z95) -> GroupAccuracy:
    """Accuracy of each group with its Wilson interval."""
    c, g = _check_inputs(correct, groups, n_groups)
    n = np.bincount(g, minlength=n_groups)
    k = np.bincount(g, weights=c, minlength=n_groups)
    with np.errstate(invalid="ignore", divide="ignore"):
        acc = np.where(n > 0, k / np.maximum(n, 1), np.nan)
    lo, hi = wilson_interval(k, n, z)
    return GroupAccuracy(n=n, correct=k.round().astype(np.int64), accuracy=acc, lower=lo, upper=hi)


def with_cluster_intervals(acc: GroupAccuracy, replicates: np.ndarray, level: float = 0.95) -> GroupAccuracy:
    """``acc`` with each group's interval replaced by the percentile interval of its cluster-bootstrap
    ``replicates`` (R, n_groups) (``bootstrap_group_accuracy`` with the key->value mappings as clusters).

    Wilson intervals treat prompts as independent; a mapping scored at several shifts of one group gives
    correlated prompts, and the Wilson interval is then too narrow (by the square root of the design effect).
    """
    r = np.asarray(replicates, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] != acc.n_groups:
        raise ValueError(f"replicates must be (R, {acc.n_groups}), got {r.shape}")
    ivs = [percentile_interval(r[:, i], float(acc.accuracy[i]), level) for i in range(acc.n_groups)]
    lo = np.array([iv.lower if acc.n[i] else 0.0 for i, iv in enumerate(ivs)])
    hi = np.array([iv.upper if acc.n[i] else 1.0 for i, iv in enumerate(ivs)])
    return dataclasses.replace(acc, lower=lo, upper=hi, interval=CLUSTER_BOOTSTRAP)


def best_minus_worst(accuracy: np.ndarray) -> np.ndarray:
    """Best-minus-worst gap over the last axis, ignoring empty (NaN) groups. (..., G) -> (...)."""
    a = np.asarray(accuracy, dtype=np.float64)
    with np.errstate(all="ignore"):
        return np.nanmax(a, axis=-1) - np.nanmin(a, axis=-1)


# ---- bootstrap over clusters -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Interval:
    """A point estimate with a two-sided interval."""

    value: float
    lower: float
    upper: float


def _cluster_index(clusters: Optional[np.ndarray], n: int) -> tuple[np.ndarray, int]:
    if clusters is None:
        return np.arange(n), n
    cl = np.asarray(clusters).reshape(-1)
    if len(cl) != n:
        raise ValueError(f"clusters has {len(cl)} entries, expected {n}")
    _, idx = np.unique(cl, return_inverse=True)
    return idx.reshape(-1), int(idx.max()) + 1 if n else 0


def bootstrap_group_accuracy(
    correct: np.ndarray,
    groups: np.ndarray,
    n_groups: int,
    clusters: Optional[np.ndarray] = None,
    n_resamples: int = 2000,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Cluster bootstrap: resample whole clusters (key->value mappings) with replacement.

    Returns ``(group_acc, mean_acc)``: (n_resamples, n_groups) per-group accuracies and (n_resamples,) overall
    accuracies of the replicates. ``clusters=None`` resamples single samples.
    """
    c, g = _check_inputs(correct, groups, n_groups)
    if n_resamples < 1:
        raise ValueError(f"n_resamples={n_resamples} must be >= 1")
    idx, n_clusters = _cluster_index(clusters, len(c))
    if n_clusters == 0:
        raise ValueError("cannot bootstrap an empty sample")
    hits = np.zeros((n_clusters, n_groups))
    counts = np.zeros((n_clusters, n_groups))
    np.add.at(hits, (idx, g), c)
    np.add.at(counts, (idx, g), 1.0)
    rng = np.random.default_rng(seed)
    chunk = max(1, _CHUNK_ELEMENTS // n_clusters)
    group_acc, mean_acc = [], []
    for start in range(0, n_resamples, chunk):
        b = min(chunk, n_resamples - start)
        weights = rng.multinomial(n_clusters, np.full(n_clusters, 1.0 / n_clusters), size=b)  # (b, C)
        h, m = weights @ hits, weights @ counts  # (b, G)
        with np.errstate(invalid="ignore", divide="ignore"):
            group_acc.append(np.where(m > 0, h / m, np.nan))
        mean_acc.append(h.sum(1) / m.sum(1))
    return np.concatenate(group_acc), np.concatenate(mean_acc)


def percentile_interval(replicates: np.ndarray, value: float, level: float = 0.95) -> Interval:
    """Percentile interval of bootstrap ``replicates`` around the point estimate ``value``."""
    if not 0 < level < 1:
        raise ValueError(f"level={level} must lie in (0, 1)")
    r = np.asarray(replicates, dtype=np.float64)
    r = r[np.isfinite(r)]
    if not len(r):
        return Interval(float(value), math.nan, math.nan)
    lo, hi = np.quantile(r, [(1 - level) / 2, (1 + level) / 2])
    return Interval(float(value), float(lo), float(hi))


# ---- permutation test ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PermutationResult:
    """Permutation test of "accuracy does not depend on the group".

    ``p_value``: share of label permutations whose gap is at least the observed gap (with the +1 correction);
    ``noise_floor``: the ``quantile`` (95th percentile) of the gap under no group effect, i.e. the gap that
    sampling noise alone produces; ``observed_gap``: the data's best-minus-worst gap.
    """

    p_value: float
    noise_floor: float
    observed_gap: float
    n_permutations: int
    # (n_permutations, n_groups) group accuracies of the permuted replicates: the null distribution the
    # minimum detectable gap shifts (``minimum_detectable_gap``)
    null_accuracy: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)), repr=False, compare=False)


def permutation_test(
    correct: np.ndarray,
    groups: np.ndarray,
    n_groups: int,
    clusters: Optional[np.ndarray] = None,
    n_permutations: int = 2000,
    quantile: float = 0.95,
    seed: int = 0,
) -> PermutationResult:
    """Shuffle group labels within each cluster (a paired test when each cluster holds one sample per group;
    ``clusters=None`` shuffles over all samples) and compare the best-minus-worst gap with the observed one."""
    c, g = _check_inputs(correct, groups, n_groups)
    if n_permutations < 1:
        raise ValueError(f"n_permutations={n_permutations} must be >= 1")
    idx, _ = _cluster_index(clusters, len(c))
    order = np.argsort(idx, kind="stable")
    c, g, idx = c[order], g[order], idx[order].astype(np.float64)
    observed = float(best_minus_worst(group_accuracy(c, g, n_groups).accuracy))
    rng = np.random.default_rng(seed)
    n = len(c)
    chunk = max(1, _CHUNK_ELEMENTS // max(n, 1))
    null_acc = []
    for start in range(0, n_permutations, chunk):
        b = min(chunk, n_permutations - start)
        # cluster index + U[0, 1) sorts clusters as blocks and shuffles inside each block
        perm = np.argsort(idx[None, :] + rng.random((b, n)), axis=1)  # (b, n)
        shuffled = g[perm] + n_groups * np.arange(b)[:, None]  # (b, n) group ids offset per replicate
        hits = np.bincount(shuffled.ravel(), weights=np.broadcast_to(c, (b, n)).ravel(), minlength=b * n_groups)
        counts = np.bincount(shuffled.ravel(), minlength=b * n_groups)
        with np.errstate(invalid="ignore", divide="ignore"):
            null_acc.append(np.where(counts > 0, hits / np.maximum(counts, 1), np.nan).reshape(b, n_groups))
    acc = np.concatenate(null_acc)  # (n_permutations, n_groups)
    null = best_minus_worst(acc)
    p = (1 + int(np.sum(null >= observed - 1e-12))) / (1 + n_permutations)
    return PermutationResult(
        p_value=p,
        noise_floor=float(np.quantile(null, quantile)),
        observed_gap=observed,
        n_permutations=n_permutations,
        null_accuracy=acc,
    )


def gap_is_real(
    p_value: Optional[float], gap_lower: Optional[float], noise_floor: Optional[float], alpha: float = 0.05
) -> bool:
    """A phase gap counts as an effect when the permutation test rejects "no phase effect" (``p < alpha``) and the
    gap's interval lies above the noise floor. A statistic that was not computed (None) does not veto."""
    return (p_value is None or p_value < alpha) and (
        gap_lower is None or noise_floor is None or gap_lower > noise_floor
    )


# ---- flatness: equivalence and power ---------------------------------------------------------------------------
VERDICTS = ("gap", "flat", "undecided", "not learned")


def gap_upper_bound(replicates: np.ndarray, alpha: float = 0.05) -> Optional[float]:
    """One-sided ``1 - alpha`` upper confidence bound of the best-minus-worst gap, from cluster-bootstrap
    ``replicates`` (R, n_groups) of the group accuracies (``bootstrap_group_accuracy``).

    The bound is the largest, over ordered pairs of groups ``(i, j)``, of the ``1 - alpha`` quantile of the
    replicates of ``acc_i - acc_j``. The true gap is ``mu_a - mu_b`` for one pair ``(a, b)``, and that pair's own
    bound alone covers it with probability ``1 - alpha``, so the maximum does too. "Gap < margin" when this bound
    is under the margin is an intersection-union test of the pairwise equivalence hypotheses (each a one-sided
    test of TOST, i.e. the upper end of a two-sided ``1 - 2 alpha`` interval): its level is ``alpha`` without a
    multiplicity correction. Unlike the percentile interval of the bootstrapped best-minus-worst gap, it does not
    add the max-min selection bias a second time. ``None`` with fewer than two non-empty groups.
    """
    r = np.asarray(replicates, dtype=np.float64)
    r = r[:, np.isfinite(r).any(axis=0)] if r.ndim == 2 else r  # drop groups that are empty in every replicate
    if r.ndim != 2 or r.shape[1] < 2 or not 0 < alpha < 1:
        return None
    diffs = r[:, :, None] - r[:, None, :]  # (R, G, G): acc_i - acc_j per replicate
    with np.errstate(all="ignore"):
        bound = np.nanquantile(diffs, 1 - alpha, axis=0)  # (G, G)
    return float(max(0.0, np.nanmax(bound)))


def is_flat(upper_bound: Optional[float], margin: float) -> bool:
    """The equivalence test: the gap's one-sided upper bound (``gap_upper_bound``) lies under ``margin``."""
    return upper_bound is not None and upper_bound < margin


def is_learned(mean_upper: Optional[float], margin: float) -> bool:
    """Whether flatness can mean anything: the mean accuracy's upper bound reaches the equivalence ``margin``. A
    model under it (e.g. 0% everywhere) has every gap under the margin whatever its phases do."""
    return mean_upper is not None and mean_upper >= margin


def gap_verdict(real: bool, flat: bool, learned: bool = True) -> str:
    """One of ``VERDICTS``: ``not learned`` when the model's accuracy is itself under the margin (``is_learned``),
    else ``flat`` when the equivalence test says so (a real gap smaller than the margin is still flat at that
    margin), else ``gap`` when the gap is real (``gap_is_real``), else ``undecided``: the evaluation can tell
    neither (too few prompts for the margin, or a gap between the noise and the margin)."""
    if not learned:
        return "not learned"
    return "flat" if flat else "gap" if real else "undecided"


# a full-attention control has learned a lookup task when its mean accuracy reaches this; below it, "as good as full
# attention" means nothing (the bar of make demo, make demo-v4 and make robust's goal and confirmation)
CONTROL_LEARNED = 0.40


def se_from_interval(lower: float, upper: float, z: float = Z95) -> float:
    """The standard error a two-sided interval ``[lower, upper]`` implies when read as normal: half-width over ``z``."""
    return (upper - lower) / (2 * z)


def noninferiority_bounds(
    values: Sequence[float],
    lowers: Sequence[float],
    uppers: Sequence[float],
    reference: float,
    reference_lower: float,
    reference_upper: float,
) -> list[float]:
    """Per estimate ``values[i]`` with its 95% interval ``[lowers[i], uppers[i]]``: the one-sided 95% lower bound of
    ``values[i] - reference`` (``reference`` with its own 95% interval), each interval read as a normal standard
    error (``se_from_interval``) and the two estimates independent (e.g. two models' bootstrap intervals). An
    estimate is non-inferior at margin ``m`` when its bound exceeds ``-m``."""
    se_ref = se_from_interval(reference_lower, reference_upper)
    return [
        v - reference - Z_ONE_SIDED_95 * (se_from_interval(lo, hi) ** 2 + se_ref**2) ** 0.5
        for v, lo, hi in zip(values, lowers, uppers)
    ]


def minimum_detectable_gap(
    correct: np.ndarray,
    groups: np.ndarray,
    n_groups: int,
    clusters: Optional[np.ndarray],
    perm: PermutationResult,
    power: float = 0.80,
    seed: int = 0,
    tolerance: float = 1e-4,
) -> Optional[float]:
    """The smallest gap ``delta`` the permutation test (``perm``, run on these data) detects with probability
    ``power``: one group lowered by ``delta``, the others unchanged (the straddling pattern; a pattern with more
    low groups is detected sooner).

    Simulation under the evaluation's own paired design. Each of ``perm``'s null replicates (labels shuffled
    within each key->value mapping, so a replicate keeps the run's prompts per group, its accuracy, and how
    consistently it answers a mapping across shifts) is one flat dataset. Group ``w`` of it (each group in
    turn) is lowered to ``p - delta`` (``p`` the replicate's mean accuracy) by dropping each of its hits with
    probability ``delta / p``: binomial thinning, normal-approximated with fixed draws from ``seed`` and
    rounded to whole prompts, so the lowered group gets a binomial variance at its own accuracy and every gap
    stays on the lattice of gaps a dataset can show. It is detected when its best-minus-worst gap exceeds the
    noise floor such a dataset would have: the run's (``perm.noise_floor``), scaled by the square root of the
    thinning's effect on the mean within-mapping variance (the permutation null's spread is proportional to
    it; a lower group has a larger binomial variance, so the floor rises with ``delta``). For a run that
    already has a phase effect the shuffled replicates also carry that effect's spread, so its value is an
    upper bound. Searched to ``tolerance``; ``None`` with fewer than two groups, without within-mapping
    variation (every mapping answered alike at every shift: the null has no spread), or when no gap up to the
    mean accuracy is detected.
    """
    c, g = _check_inputs(correct, groups, n_groups)
    a = np.asarray(perm.null_accuracy, dtype=np.float64)  # (B, G)
    n = np.bincount(g, minlength=n_groups).astype(np.float64)
    if a.ndim != 2 or a.shape[1] != n_groups:
        raise ValueError(f"perm.null_accuracy must be (B, {n_groups}), got {a.shape}")
    keep = np.isfinite(a).all(axis=0) & (n > 0)
    a, n = a[:, keep], n[keep]
    b, k = a.shape
    if k < 2 or b == 0:
        return None
    idx, n_clusters = _cluster_index(clusters, len(c))
    size = np.bincount(idx, minlength=n_clusters).astype(np.float64)  # (C,) prompts per mapping
    m = np.bincount(idx, weights=c, minlength=n_clusters) / size  # (C,) accuracy per mapping
    within = float(np.mean(m * (1 - m)))  # mean within-mapping variance of the flat (shuffled) data
    hits = np.rint(a * n)  # (B, k)
    p = float(c.mean())  # every replicate's accuracy: shuffling within mappings keeps the hits
    if within <= 0 or p <= 0:
        return None
    z = np.random.default_rng(seed).standard_normal((k, b))  # (k, B) one draw per lowered group and replicate
    rows = np.arange(b)

    def detected(delta: float) -> bool:
        drop = min(1.0, delta / p)  # chance that a hit of the lowered group is dropped
        kept = 1 - drop
        lost = drop * m / k  # (C,) expected accuracy a mapping loses (a k-th of its prompts are in the group)
        thinned_within = np.mean((m - lost) * (1 - m + lost) - drop * kept * m / (k * size))
        floor = perm.noise_floor * math.sqrt(max(thinned_within, 0.0) / within)
        found = 0
        for w in range(k):
            thinned = hits[:, w] * kept + z[w] * np.sqrt(hits[:, w] * kept * (1 - kept))
            acc = a.copy()
            acc[rows, w] = np.clip(np.rint(thinned), 0, hits[:, w]) / n[w]
            found += int(np.sum(best_minus_worst(acc) > floor + 1e-9))
        return found >= power * k * b

    lo, hi = 0.0, p
    if not detected(hi):
        return None
    while hi - lo > tolerance:  # detection grows with delta once delta exceeds the null's spread
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if detected(mid) else (mid, hi)
    return hi


# ---- periodicity -----------------------------------------------------------------------------------------------
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


# ---- everything one grouping reports ---------------------------------------------------------------------------
@dataclass(frozen=True)
class StatsOptions:
    """Resampling settings shared by every statistic of a report."""

    n_bootstrap: int = 2000
    n_permutations: int = 2000
    level: float = 0.95
    alpha: float = 0.05
    seed: int = 0
    equivalence_margin: float = 0.05  # "flat": the gap's one-sided 1 - alpha upper bound is under this margin
    mde_power: float = 0.80  # the minimum detectable gap is the gap detected with this power at alpha

    def __post_init__(self) -> None:
        for name in ("n_bootstrap", "n_permutations"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"stats.{name}={v!r} must be an integer >= 1")
        for name in ("level", "alpha", "equivalence_margin", "mde_power"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
                raise ValueError(f"stats.{name}={v!r} must be a number in (0, 1)")


def _finite(x: float) -> Optional[float]:
    return float(x) if x is not None and math.isfinite(x) else None


def summarize_groups(
    correct: np.ndarray,
    groups: np.ndarray,
    n_groups: int,
    clusters: Optional[np.ndarray] = None,
    options: StatsOptions = StatsOptions(),
    period: Optional[int] = None,
) -> dict:
    """The full report of one grouping, as plain JSON-ready values (NaN becomes ``None``).

    Keys: ``groups`` (per group: n, correct, accuracy and its interval), ``interval`` (the per-group interval
    kind: ``cluster_bootstrap`` over ``clusters`` when given, else ``wilson``), ``mean`` (overall accuracy with a
    bootstrap interval), ``gap`` (best minus worst group with a bootstrap interval, its ``interval`` kind, the
    best and worst groups, the permutation p-value and noise floor; ``real`` (``gap_is_real``); the equivalence
    test: ``upper_one_sided`` (``gap_upper_bound`` at ``1 - alpha``), ``margin`` and ``flat``; ``verdict``
    (``gap_verdict``); and ``mde``, the gap detected with power ``mde_power`` (``minimum_detectable_gap``)) and,
    when ``period`` is given,
    ``periodicity`` (score at ``period`` with its chance level, and the dominant period of the group curve;
    only for ``2 <= period < n_groups``).
    """
    acc = group_accuracy(correct, groups, n_groups)
    boot_groups, boot_mean = bootstrap_group_accuracy(
        correct, groups, n_groups, clusters, options.n_bootstrap, options.seed
    )
    if clusters is not None:
        acc = with_cluster_intervals(acc, boot_groups, options.level)
    perm = permutation_test(
        correct, groups, n_groups, clusters, options.n_permutations, 1 - options.alpha, options.seed
    )
    c = np.asarray(correct, dtype=np.float64)
    gap = percentile_interval(best_minus_worst(boot_groups), perm.observed_gap, options.level)
    mean = percentile_interval(boot_mean, float(c.mean()) if len(c) else math.nan, options.level)
    filled = np.where(np.isnan(acc.accuracy), np.inf, acc.accuracy)
    worst = int(np.argmin(filled))
    best = int(np.argmax(np.where(np.isnan(acc.accuracy), -np.inf, acc.accuracy)))
    boot_kind = CLUSTER_BOOTSTRAP if clusters is not None else BOOTSTRAP
    real = gap_is_real(perm.p_value, _finite(gap.lower), perm.noise_floor, options.alpha)
    upper_one_sided = gap_upper_bound(boot_groups, options.alpha)
    learned = is_learned(_finite(mean.upper), options.equivalence_margin)
    flat = learned and is_flat(upper_one_sided, options.equivalence_margin)
    mde = minimum_detectable_gap(correct, groups, n_groups, clusters, perm, options.mde_power, options.seed)
    out: dict = {
        "groups": [
            {
                "group": i,
                "n": int(acc.n[i]),
                "correct": int(acc.correct[i]),
                "accuracy": _finite(acc.accuracy[i]),
                "lower": _finite(acc.lower[i]),
                "upper": _finite(acc.upper[i]),
            }
            for i in range(n_groups)
        ],
        "interval": acc.interval,
        "mean": {
            "value": _finite(mean.value),
            "lower": _finite(mean.lower),
            "upper": _finite(mean.upper),
            "n": len(c),
            "interval": boot_kind,
        },
        "gap": {
            "value": _finite(gap.value),
            "lower": _finite(gap.lower),
            "upper": _finite(gap.upper),
            "interval": boot_kind,
            "best_group": best,
            "worst_group": worst,
            "best_accuracy": _finite(acc.accuracy[best]),
            "worst_accuracy": _finite(acc.accuracy[worst]),
            "worst_lower": _finite(acc.lower[worst]),
            "worst_upper": _finite(acc.upper[worst]),
            "p_value": perm.p_value,
            "noise_floor": perm.noise_floor,
            "n_permutations": perm.n_permutations,
            "n_bootstrap": options.n_bootstrap,
            "level": options.level,
            "real": real,
            "upper_one_sided": upper_one_sided,
            "upper_one_sided_level": 1 - options.alpha,
            "margin": options.equivalence_margin,
            "flat": flat,
            "verdict": gap_verdict(real, flat, learned),
            "mde": mde,
            "mde_power": options.mde_power,
            "alpha": options.alpha,
        },
    }
    curve = acc.accuracy
    if period is not None and 2 <= period < n_groups and np.all(np.isfinite(curve)):
        dom = dominant_period(curve, options.alpha)
        out["periodicity"] = {
            "period": period,
            "score": periodicity_score(curve, period),
            "chance": periodicity_chance(n_groups, period),
            "dominant_period": dom.period,
            "dominant_p_value": dom.p_value,
            "dominant_score": dom.score,
        }
    return out
