"""Flatness of a best-minus-worst gap: the equivalence test (its one-sided upper bound under a margin), the verdict
(gap / flat / undecided / not learned: ``gap_verdict``, the one rule every report, table and claim applies, and
``row_verdict``, the same from a report row's numbers), non-inferiority bounds against a reference, and the minimum
detectable gap (power); pure functions on numpy arrays, on ``ckv.eval.stats``' resampling."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np

from ckv.eval.stats import Z95, PermutationResult, best_minus_worst, check_groups, cluster_index, gap_is_real

Z_ONE_SIDED_95 = 1.6448536269514722  # one-sided 95% standard-normal quantile
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
    """One of ``VERDICTS``, the one rule that decides a significant gap against a flat one: ``not learned`` when the
    model's accuracy is itself under the margin (``is_learned``), else ``gap`` when the gap is significant
    (``gap_is_real``: permutation p under alpha and the interval above the noise floor), even one whose one-sided
    upper bound is under the margin, else ``flat`` when the equivalence test says so (``is_flat``), else
    ``undecided``: the evaluation can tell neither (too few prompts for the margin, or a gap between the noise and
    the margin). Significance comes first: a gap the evaluation detects is a gap, whatever its size; "flat" is
    claimed only of a gap the evaluation does not detect and bounds under the margin."""
    if not learned:
        return "not learned"
    return "gap" if real else "flat" if flat else "undecided"


def row_verdict(row: Mapping[str, Any], prefix: str, margin: Optional[float] = None, alpha: float = 0.05) -> str:
    """``gap_verdict`` of one grouping (``prefix``: ``phase`` or ``residue``) from a report row's numbers, as the
    studies' rows hold them (the lookup headline and ``ckv.eval.summary.flatness_fields``): significance from
    ``<prefix>_p_value``, ``<prefix>_gap_lower`` and ``<prefix>_noise_floor``; flatness from
    ``<prefix>_upper_one_sided`` under ``margin`` (default: the evaluation's own, ``<prefix>_margin``); learned from
    ``mean_upper``. Recomputed, not read from the stored verdict, so that a report over results written under an
    older rule applies this one. A row without a margin (its report predates the equivalence test) is never flat."""
    margin = row.get(f"{prefix}_margin") if margin is None else margin
    real = gap_is_real(row[f"{prefix}_p_value"], row[f"{prefix}_gap_lower"], row[f"{prefix}_noise_floor"], alpha)
    if margin is None:
        return gap_verdict(real, flat=False)
    return gap_verdict(
        real, is_flat(row.get(f"{prefix}_upper_one_sided"), margin), is_learned(row.get("mean_upper"), margin)
    )


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
    c, g = check_groups(correct, groups, n_groups)
    a = np.asarray(perm.null_accuracy, dtype=np.float64)  # (B, G)
    n = np.bincount(g, minlength=n_groups).astype(np.float64)
    if a.ndim != 2 or a.shape[1] != n_groups:
        raise ValueError(f"perm.null_accuracy must be (B, {n_groups}), got {a.shape}")
    keep = np.isfinite(a).all(axis=0) & (n > 0)
    a, n = a[:, keep], n[keep]
    b, k = a.shape
    if k < 2 or b == 0:
        return None
    idx, n_clusters = cluster_index(clusters, len(c))
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
